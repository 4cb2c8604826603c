"""``stream_chunk_size="auto"`` under the CUDA simulator (``../shared/cudasim``): the chosen chunk keeps the step's
simulated peak within ``memory_budget``. A script run in a subprocess by ``tests/test_memory_model.py`` (the
simulator must be imported before torch)::

    python tests/cuda_sim_auto.py CUDASIM_DIR SEQ_LEN BUDGET_BYTES     # one JSON line on stdout
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, sys.argv[1])
import fakecuda  # noqa: E402, F401  (before torch)
import sim  # noqa: E402
import torch  # noqa: E402

from streambp_trl.engine import chunk_sizes  # noqa: E402

seq_len, budget = int(sys.argv[2]), int(sys.argv[3])
chosen = {}
original = sim.prepare


def prepare(model, mode, chunk, logits_chunk, stream_kwargs=None):
    loss_fn = original(model, mode, chunk, logits_chunk, stream_kwargs)

    def run(ids):
        loss = loss_fn(ids)
        chosen[chunk] = chunk_sizes(model)
        return loss

    return run


sim.prepare = prepare
result = {}
for chunk in ("auto", 16384):
    kwargs = {"verify": False, "memory_budget": f"{budget}B"} if chunk == "auto" else {"verify": False}
    rec = sim.simulate(
        "small",
        torch.bfloat16,
        "streambp",
        seq_len,
        chunk=chunk,
        logits_chunk=chunk,
        grads_ready=True,
        stream_kwargs=kwargs,
    )
    result[str(chunk)] = {"peak_bytes": rec["peak_gib"] * 2**30, "chunks": chosen[chunk], "sdpa": rec["sdpa"]}
print(json.dumps(result), flush=True)
os._exit(0)
