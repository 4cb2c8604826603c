"""The engine on (simulated) CUDA: SDPA never takes the math kernel, and no CPU tensor enters CUDA work.

Runs ``tests/cuda_sim_run.py`` in a subprocess under the CUDA simulator of ``../shared/cudasim`` (FakeTensors on device
``cuda``, SDPA dispatched by sm80 rules: flash > memory-efficient > math). The simulator must be imported before
torch, hence the subprocess. The math kernel would hold a (chunk x prefix x heads) score tensor; a CPU tensor mixed
into CUDA work raises ``FakeTensorDeviceMismatchError`` there, as it would fail on a GPU. Deliberately broken engines
check that both failures are caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CUDASIM, cudasim_missing
from model_support import streamed_here

pytestmark = pytest.mark.slow  # every case runs under ../shared/cudasim

RUNNER = Path(__file__).with_name("cuda_sim_run.py")

if cudasim_missing():
    pytest.skip(cudasim_missing(), allow_module_level=True)


def _run(*args: str) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(CUDASIM), *args],
        cwd=Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"simulation failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    return {r["case"]: r for r in _run("all")}


# case -> the kernels it must use (and nothing else)
EXPECTED = {
    "causal-gqa-bf16": {"flash"},
    "causal-mha-bf16": {"flash"},
    "causal-mqa-bf16": {"flash"},
    "causal-gqa-fp32": {"efficient"},
    "causal-mha-fp32": {"efficient"},
    "padded-gqa-bf16": {"efficient"},  # right-padded batch: a mask block
    "padded-mha-bf16": {"efficient"},
    "sliding-gqa-bf16": {"efficient"},  # Mistral, sliding window 48 < sequence
    "sliding-mha-fp32": {"efficient"},
    "sliding-layers-bf16": {"flash", "efficient"},  # Qwen2: one full-attention layer, one sliding-window layer
    "head-dim-512-bf16": {"efficient"},  # past flash's head_dim limit
    "dynamic-mask-gqa-bf16": {"efficient"},  # Doge: a per-head bias with gradient, all heads in one call
    "dynamic-mask-mha-fp32": {"efficient"},
    # the sweep's tiny models, padded: keys/values shared across layers (Gemma 4), with AltUp (Gemma 3n), a
    # relative-position bias and per-query sinks (Inkling 2), a router stream and a mapping of masks (Zaya)
    "shared-kv-bf16": {"efficient"},
    "altup-shared-kv-bf16": {"efficient"},
    **({"position-bias-bf16": {"efficient"}} if streamed_here("inkling2_text") else {}),
    "router-stream-bf16": {"efficient"},
    # BLT: the byte stacks' padded chunks and the whole-sequence cross-attention (a dense patch mask) take the
    # memory-efficient kernel, the patch stack's chunks (its causal mask is built without padding) flash
    "byte-patch-bf16": {"efficient", "flash"},
    # DeepSeek-V4: its sliding-window chunks with the compressed entries' block bias appended (a dense mask)
    "compressed-bf16": {"efficient"},
    "cudnn-gqa-bf16": set(),  # cuDNN's form: its own ops, no SDPA call
    "cudnn-mha-bf16": set(),
    "cudnn-padded-bf16": {"efficient"},  # a mask block: never cuDNN's form
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_kernels_only(cases, name):
    r = cases[name]
    assert "error" not in r, r["error"]
    assert set(r["sdpa"]) == EXPECTED[name], r["sdpa"]
    assert r["grads"] > 0 and r["grad_devices"] == ["cuda"]


@pytest.mark.parametrize(
    "name",
    [name for name in EXPECTED if name in ("shared-kv-bf16", "altup-shared-kv-bf16", "position-bias-bf16")]
    + ["router-stream-bf16", "byte-patch-bf16"],
)
def test_model_specific_paths_give_every_parameter_its_gradient_on_cuda(cases, name):
    assert cases[name]["grads"] == cases[name]["params"], cases[name]


def test_compressed_attention_gives_every_trained_parameter_its_gradient_on_cuda(cases):
    """All but the lightning indexer's parameters, which no gradient reaches in the plain model either (its output is
    the chosen entries' indices)."""
    r = cases["compressed-bf16"]
    assert r["no_grad"] and all(".indexer." in n for n in r["no_grad"]), r["no_grad"]


def test_grouped_heads_run_per_key_value_head(cases):
    """Grouped-query attention runs one call per key/value head (2 here), multi-head and multi-query one call."""
    mha = cases["causal-mha-bf16"]["sdpa"]["flash"]
    assert cases["causal-mqa-bf16"]["sdpa"]["flash"] == mha
    assert cases["causal-gqa-bf16"]["sdpa"]["flash"] == 2 * mha
    assert cases["causal-gqa-fp32"]["sdpa"]["efficient"] == 2 * cases["causal-mha-fp32"]["sdpa"]["efficient"]


def test_dynamic_mask_runs_all_heads_in_one_call(cases):
    """Doge's per-head bias (with gradient) goes with all query heads in one memory-efficient call, grouped-query heads
    too (as many calls as multi-head), and its gradient reaches every parameter (the bias's A and dt_proj among
    them)."""
    gqa, mha = cases["dynamic-mask-gqa-bf16"], cases["dynamic-mask-mha-fp32"]
    assert gqa["sdpa"]["efficient"] == mha["sdpa"]["efficient"]
    assert gqa["grads"] == gqa["params"] and mha["grads"] == mha["params"]


def test_cudnn_form_on_cuda_tensors(cases):
    """Where cuDNN's form is taken (as on an sm90 GPU whose check passed), every plainly causal chunk runs its prefix
    and diagonal calls on CUDA tensors, the last chunk (32 tokens) padded to 64, forward and backward; several
    key/value heads per call (GQA: one call for 2 key/value heads; MHA: two of 4 heads each)."""
    gqa, mha = cases["cudnn-gqa-bf16"]["cudnn"], cases["cudnn-mha-bf16"]["cudnn"]
    # 2 layers x (forward + recompute) x 3 chunks, the 2nd and 3rd with a prefix call: 20 forward calls
    assert gqa == {"forward": 20, "backward": 10, "padded": 4}, gqa
    assert mha == {"forward": 40, "backward": 20, "padded": 8}, mha
    assert cases["cudnn-padded-bf16"]["cudnn"]["forward"] == 0


def test_no_fused_kernel_is_a_clear_error(cases):
    error = cases["float64"]["error"]
    assert error.startswith("RuntimeError: StreamBP found no fused CUDA attention kernel for qwen3"), error
    assert "dtype float64" in error and "head_dim 16" in error and "bfloat16" in error
    assert cases["float64"]["sdpa"] == {}


def test_simulation_catches_a_cpu_tensor_in_cuda_work(cases):
    """A mask block allocated without ``device=`` (on the CPU) and filled from a CUDA block."""
    assert cases["bug-cpu-mask"]["error"].startswith("FakeTensorDeviceMismatchError"), cases["bug-cpu-mask"]


def test_simulation_catches_the_math_kernel(cases):
    """The attention before it chose kernels (SDPA's own choice, enable_gqa=True in float32) takes math."""
    assert "math" in cases["bug-math-attention"]["sdpa"], cases["bug-math-attention"]


def test_grouped_heads_backward_workspace():
    """One chunk's attention forward + backward at Qwen3-8B's heads (32 query, 8 key/value, head_dim 128, bf16):
    what grows with the prefix is the keys/values (2 x 2 KiB per token, the stream layer's concatenation), their
    gradients (2 x 2 KiB) and one group's flash workspace (dK/dV expanded to 4 heads: 2 KiB) and dK/dV (0.5 KiB),
    10.5 KiB per prefix token; one call over all heads would add flash's all-head workspace (16 KiB per token)."""
    short, long = _run("--attention-layer", "4096", "512"), _run("--attention-layer", "12288", "512")
    per_token = (long[0]["peak_above_inputs_mib"] - short[0]["peak_above_inputs_mib"]) * 2**20 / 8192
    assert per_token <= 10.5 * 1024 + 64, per_token / 1024
    assert set(long[0]["sdpa"]) == {"flash"}


def test_cudnn_form_backward_takes_no_more_than_flash():
    """cuDNN's form at the same shapes, two key/value heads per call: the prefix's and the chunk's key/value
    gradients and their join (2 x 1 KiB per token) instead of flash's expanded workspace and dK/dV (2.5 KiB):
    10 KiB per prefix token (the simulator counts the tensors the ops return, not a kernel's private workspace)."""
    short, long = (_run("--attention-layer", str(n), "512", "1")[0] for n in (4096, 12288))
    per_token = (long["peak_above_inputs_mib"] - short["peak_above_inputs_mib"]) * 2**20 / 8192
    assert per_token <= 10 * 1024 + 64, per_token / 1024
    assert long["sdpa"] == {} and long["cudnn"]["backward"] == 8  # 4 calls of 2 key/value heads, 2 parts each
