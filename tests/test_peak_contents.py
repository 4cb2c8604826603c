"""What a streamed step holds at its peak, under the CUDA simulator (``../shared/cudasim``): Qwen3-8B's widths (a
(151,936 x 4096) LM head) with two layers, parameter gradients already allocated, at 32,768 tokens.

Without a memory figure (the simulator's CUDA device has no runtime to ask, as a device without one), the engine
must take the forms that hold least: at the peak there is no float32 (vocab x hidden) tensor (the LM head's gradient
accumulated whole), no float32 (tokens x hidden) one, and no full-length (tokens x hidden) tensor beyond the saved
layer inputs and the hidden states' gradient (two layers: one saved input, the first layer's being rebuilt from the
token ids, and one gradient; or, in the head's backward, the final hidden states the head reads). The calls are
those of every stream trainer: SFT's token mean, the weighted rows of DPO / KTO / GRPO / RLOO, the model's own
``labels=`` loss, and the distillation trainer's divergence kernel (in the form the trainer takes for the model).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CUDASIM, cudasim_missing

pytestmark = pytest.mark.slow  # runs under ../shared/cudasim

ROOT = Path(__file__).parents[1]
SEQ_LEN, VOCAB, HIDDEN = 32768, 151936, 4096

if cudasim_missing():
    pytest.skip(cudasim_missing(), allow_module_level=True)


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cuda_sim_peak.py"), str(CUDASIM), str(SEQ_LEN), "token-mean"]
        + ["weighted", "labels", "distillation"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"simulation failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return {r["case"]: r for r in map(json.loads, (x for x in proc.stdout.splitlines() if x.startswith("{")))}


@pytest.mark.parametrize("case", ["token-mean", "weighted", "labels", "distillation"])
def test_nothing_whole_beyond_the_inputs_and_their_gradient_at_the_peak(records, case):
    live = records[case]["live"]
    numel = [math.prod(shape) for _, _, shape, *_ in live]
    head_sized = [x for x, n in zip(live, numel, strict=True) if x[1] == "float32" and n >= VOCAB * HIDDEN]
    assert not head_sized, f"a float32 (vocab x hidden) tensor at the peak: {head_sized} ({records[case]['at_peak']})"
    f32_rows = [x for x, n in zip(live, numel, strict=True) if x[1] == "float32" and n >= SEQ_LEN * HIDDEN]
    assert not f32_rows, f"a float32 (tokens x hidden) tensor at the peak: {f32_rows}"
    full = [x for x, n in zip(live, numel, strict=True) if n >= SEQ_LEN * HIDDEN and SEQ_LEN in x[2]]
    assert len(full) <= 2, f"more full-length tensors than one saved input and one gradient: {full}"
