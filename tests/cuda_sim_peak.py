"""What is alive at a streamed step's simulated CUDA peak (``../shared/cudasim``), for Qwen3-8B's widths with two
layers. A script run in a subprocess by ``tests/test_peak_contents.py`` (the simulator must be imported before
torch)::

    python tests/cuda_sim_peak.py CUDASIM_DIR SEQ_LEN CASE [CASE ...]     # one JSON line per case on stdout

Cases are the calls the stream trainers make: ``token-mean`` (SFT: ``fused_lm_head=True`` with
``token_mean_loss=True``, so the logit kernel may form its gradient in the forward), ``weighted`` (DPO, KTO, GRPO,
RLOO: ``fused_lm_head=True``, each row's log-probability weighted by the loss), ``labels`` (the model's own
``labels=`` loss). Each line has the peak, where it was, and every tensor storage of at least ``SEQ_LEN x 1024``
elements live at the peak (GiB, dtype, shape, the op that made it, forward/backward), the parameters and their
gradients left out.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, sys.argv[1])
import fakecuda  # noqa: E402, F401  (before torch)
import sim  # noqa: E402
import torch  # noqa: E402

seq_len, cases = int(sys.argv[2]), sys.argv[3:]
OPTIONS = {"token-mean": {"token_mean_loss": True}, "weighted": {}, "labels": {}}
MODES = {"token-mean": "streambp", "weighted": "streambp", "labels": "streambp-labels"}
for case in cases:
    kwargs = {"verify": False, **OPTIONS[case]}
    rec = sim.simulate(
        "qwen3-8b",
        torch.bfloat16,
        MODES[case],
        seq_len,
        chunk=2048,
        logits_chunk=2048,
        grads_ready=True,
        stream_kwargs=kwargs,
        layers=2,
        who=64,
    )
    big = [x for x in rec["live_at_peak"] if x[3] not in ("model", "grads")]
    print(json.dumps({"case": case, "peak_gib": rec["peak_gib"], "at_peak": rec["at_peak"], "live": big}), flush=True)
os._exit(0)
