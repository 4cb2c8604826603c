"""The engine on a real CUDA GPU (skipped without one): exactness in bfloat16 and float32, the attention kernels it
takes, checkpoint offload overlapping compute, and peak memory against the memory model.

* **Exactness.** bfloat16 and float32 cannot agree with plain autograd to float64 rounding, so both the streamed and
  the plain step on the GPU are measured against a float64 reference on the CPU (the same weights and batch; float32
  internals computed in float64, :class:`Float64Internals`). The streamed loss and each parameter's gradient must
  be as close to it as the plain step's are, up to a factor 2 and a slack of one unit of the dtype's rounding
  (``2**-7`` for bfloat16, ``1e-6`` for float32, relative). A missing prefix term or a dropped carry gradient is off
  by orders of magnitude more. The paths served for one model type each (Gemma 4's and Gemma 3n's shared
  keys/values, Doge's dynamic mask, Zaya's router stream, Inkling 2's position bias) are held to 4x. The recurrent
  mixers' carry (Gated DeltaNet, Mamba2, short convolution) also runs in float64 on the GPU, where it must agree
  with plain autograd to ``1e-10``.
* **Kernels.** The profiler's operator names show cuDNN attention (compute capability 9.0+; flash before) for
  unpadded bfloat16 chunks, the memory-efficient kernel for float32 and masked chunks, and never SDPA's math kernel
  (a chunk x prefix score tensor). cuDNN's form (prefix and diagonal merged) is as close to a float64 reference as
  flash at Qwen3-8B's head shapes.
* **Offload.** A profiler trace of a step with ``offload_checkpoints=True`` shows the device-to-host copies on a
  stream other than the compute stream, and most of their time overlapping compute kernels.
* **Memory.** ``torch.cuda.max_memory_allocated`` of a Qwen3-4B / Qwen3-8B-shaped step (random weights, bfloat16,
  parameter gradients allocated before the step) within 5% of the memory model
  (:func:`streambp_trl.sizing.memory_model.estimate_peak_bytes`).

With ``STREAMBP_CUDA_REPORT=FILE`` set, each test appends what it measured to ``FILE`` as JSON lines (the figures
recorded in ``benchmarks/``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zoo
from model_support import Float64Internals, streamed_here
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from trace_waits import copy_waits
from zoo import FLOAT32_KEPT, batch, tiny_causal_lm

from streambp_trl import disable_streambp, enable_streambp
from streambp_trl.attention import cuda
from streambp_trl.attention.causal_chunk import cudnn_usable
from streambp_trl.engine import last_head_form, last_plan
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.layout import Layout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SEQ_LEN = 515  # no chunk size below divides it
CHUNK, LOGITS_CHUNK = 128, 96
SLACK = {torch.bfloat16: 2.0**-7, torch.float32: 1e-6}
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
# family -> config overrides: grouped heads with q/k norms, a sliding window, softcapped scores, two hybrids
FAMILIES = {
    "qwen3": WIDE,
    "mistral": {**WIDE, "sliding_window": 100},
    "gemma2": {**WIDE, "sliding_window": 100},
    "qwen3_5_text": {},  # Gated DeltaNet beside full attention (transformers' torch path without the fla kernels)
    "nemotron_h": {},  # Mamba2, MoE, attention and MLP layers
}
# model type -> paddings compared (Gemma 3n: right only, transformers' own backward gives NaN on its left padding)
MODEL_SPECIFIC = {
    "gemma4_text": ("none", "left"),
    "gemma3n_text": ("right",),
    "doge": ("none", "right"),
    "zaya": ("right",),
    **({"inkling2_text": ("left",)} if streamed_here("inkling2_text") else {}),
}
# Doge's top-k window over per-key biases flips its choice under bf16 rounding: plain's own bf16 gradients are up to
# 4x off float64's (H200, 2026-11-27), so a bf16 comparison says nothing; float32 (plain's and streamed's errors
# within 0.2% of each other there) and float64 (tests/test_dynamic_mask.py) do
FLOAT32_ONLY = {"doge"}
ONE_MIXER = {
    "gated_deltanet": ("qwen3_5_text", {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}),
    "mamba2": ("mamba2", {"num_hidden_layers": 1}),
    "short_conv": ("lfm2", {"num_hidden_layers": 1, "layer_types": ["conv"]}),
}


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _report(**record) -> None:
    path = os.environ.get("STREAMBP_CUDA_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _step(model, inputs, device: str, reference: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and float64 parameter gradients (on the CPU) of one forward/backward on ``device``; ``reference``: a
    float64 model's step with its float32 internals in float64 too."""
    ids, mask, labels = (t.to(device) for t in inputs)
    with Float64Internals() if reference else contextlib.nullcontext():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _errors(result, reference) -> dict[str, float]:
    """Relative error of the loss and of each parameter's gradient against the reference."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert grads.keys() == ref_grads.keys()
    floor = 1e-8 * max(g.norm() for g in ref_grads.values())
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errors[name] = ((grads[name] - ref).norm() / torch.maximum(ref.norm(), floor)).item()
    return errors


@pytest.fixture(params=["cudnn", "flash"])
def causal_kernel(request, monkeypatch):
    """Which kernel plainly causal bfloat16 chunks take: cuDNN's form (on compute capability 9.0+; every chunk
    length here, not only multiples of ``CUDNN_ALIGN``), or flash (cuDNN's check answered no, as before Hopper)."""
    if request.param == "cudnn":
        monkeypatch.setattr(cuda, "CUDNN_ALIGN", 1)
    else:
        monkeypatch.setattr(cuda, "cudnn_usable", lambda device, dtype, head_dim: False)
    return request.param


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_is_as_exact_as_plain_on_cuda(family, dtype, padding, causal_kernel):
    if dtype == torch.float32 and causal_kernel == "flash":
        pytest.skip("float32 takes the memory-efficient kernel either way")
    model = tiny_causal_lm(family, **FAMILIES[family])
    inputs = batch(2, SEQ_LEN, padding=padding)
    reference = _step(copy.deepcopy(model), inputs, "cpu", reference=True)
    plain = _errors(_step(copy.deepcopy(model).to("cuda", dtype), inputs, "cuda"), reference)
    streamed_model = enable_streambp(
        copy.deepcopy(model).to("cuda", dtype), stream_chunk_size=CHUNK, logits_chunk_size=LOGITS_CHUNK
    )
    streamed = _errors(_step(streamed_model, inputs, "cuda"), reference)
    worst = max(streamed, key=lambda n: streamed[n] / (2 * plain[n] + SLACK[dtype]))
    _report(
        test="exactness", family=family, dtype=str(dtype), padding=padding, causal_kernel=causal_kernel, worst=worst,
        streamed_error=streamed[worst], plain_error=plain[worst],
        max_streamed_error=max(streamed.values()), max_plain_error=max(plain.values()),
    )  # fmt: skip
    for name, err in streamed.items():
        assert err <= 2 * plain[name] + SLACK[dtype], f"{name}: streamed {err:.2e}, plain {plain[name]:.2e}"


@pytest.mark.parametrize(
    ("family", "padding", "dtype"),
    [
        pytest.param(f, p, d, id=f"{f}-{p}-{name}")
        for f, paddings in MODEL_SPECIFIC.items()
        for p in paddings
        for d, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
        if not (f in FLOAT32_ONLY and d == torch.bfloat16)
    ],
)
def test_model_specific_paths_are_as_exact_as_plain_on_cuda(family, padding, dtype, monkeypatch):
    """The paths the engine serves for one model type each (the sweep's tiny configs, eager experts), against the
    same float64 CPU reference as above: keys/values shared across layers (Gemma 4; Gemma 3n with AltUp's stacked
    streams), a dynamic mask with a per-key bias and a top-k window (Doge: its mask blocks and their gradient in one
    memory-efficient call), a second per-token stream with gradient (Zaya), a relative-position bias and a sink per
    query (Inkling 2: its float32 router kept float32 on the GPU, as loading keeps it). Within 4x the plain step's
    error (and the dtype's slack): Doge's ``A`` gradient, a sum over every key, is ill-conditioned (plain's own error
    4e-5 in float32 on the CPU, streamed's 2.3x that; in float64 both agree to 3e-13, tests/test_dynamic_mask.py)."""
    monkeypatch.setattr(zoo, "FLOAT32_KEPT", set())  # the reference: every weight float64
    model = tiny_causal_lm(family)
    inputs = batch(2, SEQ_LEN, padding=padding)
    reference = _step(copy.deepcopy(model), inputs, "cpu", reference=True)
    kept = (getattr(model, "_keep_in_fp32_modules_strict", None) or []) if family in FLOAT32_KEPT else []

    def on_gpu():
        gpu = copy.deepcopy(model).to("cuda", dtype)
        for name, t in [*gpu.named_parameters(), *gpu.named_buffers()]:
            if any(k in name for k in kept):
                t.data = t.data.float()
        return gpu

    plain = _errors(_step(on_gpu(), inputs, "cuda"), reference)
    streamed = _errors(_step(enable_streambp(on_gpu(), stream_chunk_size=CHUNK, logits_chunk_size=LOGITS_CHUNK),
                             inputs, "cuda"), reference)  # fmt: skip
    worst = max(streamed, key=lambda n: streamed[n] / (4 * plain[n] + SLACK[dtype]))
    _report(
        test="exactness_model_specific", family=family, dtype=str(dtype), padding=padding, worst=worst,
        streamed_error=streamed[worst], plain_error=plain[worst],
        max_streamed_error=max(streamed.values()), max_plain_error=max(plain.values()),
    )  # fmt: skip
    for name, err in streamed.items():
        assert err <= 4 * plain[name] + SLACK[dtype], f"{name}: streamed {err:.2e}, plain {plain[name]:.2e}"


@pytest.mark.parametrize("chunk", [1, 5, 23])
@pytest.mark.parametrize("mixer", ONE_MIXER)
def test_recurrent_carry_is_exact_in_float64_on_cuda(mixer, chunk):
    """The carry between chunks of one recurrent or convolution layer, in float64 on the GPU (the layers' float32
    internals too), against plain autograd on the GPU."""
    family, overrides = ONE_MIXER[mixer]
    reference = tiny_causal_lm(family, **overrides).cuda()
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    inputs = batch(padding="right")
    errors = _errors(_step(streamed, inputs, "cuda", reference=True), _step(reference, inputs, "cuda", reference=True))
    _report(test="carry_float64", mixer=mixer, chunk=chunk, max_error=max(errors.values()))
    assert max(errors.values()) < 1e-10, max(errors.items(), key=lambda kv: kv[1])


def _sdpa_ops(model, inputs) -> set[str]:
    """The SDPA operators one streamed step calls (forward and backward), by the profiler's operator names."""
    ids, mask, labels = (t.cuda() for t in inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    names = {e.key for e in prof.key_averages()}
    return {n for n in names if "attention" in n and n.startswith("aten::_")}


def _causal_kernel(dtype: torch.dtype, head_dim: int) -> str:
    """The kernel a plainly causal chunk takes: cuDNN's (prefix and diagonal merged) where its check passes, flash
    otherwise (float16/bfloat16), memory-efficient in float32."""
    if dtype == torch.float32:
        return "efficient"
    return "cudnn" if cudnn_usable(torch.device("cuda"), dtype, head_dim) else "flash"


@pytest.mark.parametrize(
    ("dtype", "padding", "family", "kernel"),
    [
        (torch.bfloat16, "none", "qwen3", "causal"),  # bottom-right causal chunks: cuDNN (Hopper) or flash
        (torch.bfloat16, "right", "qwen3", "efficient"),  # a mask block
        (torch.bfloat16, "none", "mistral", "efficient"),  # a sliding window
        (torch.float32, "none", "qwen3", "efficient"),  # flash and cuDNN have no float32
    ],
)
def test_attention_kernels(dtype, padding, family, kernel, monkeypatch):
    monkeypatch.setattr(cuda, "CUDNN_ALIGN", 1)  # the tiny model's chunks are no multiples of 256
    if kernel == "causal":
        kernel = _causal_kernel(dtype, FAMILIES[family]["head_dim"])
    model = enable_streambp(
        tiny_causal_lm(family, **FAMILIES[family]).to("cuda", dtype), stream_chunk_size=CHUNK, verify=False
    )
    ops = _sdpa_ops(model, batch(2, SEQ_LEN, padding=padding))
    _report(test="kernels", family=family, dtype=str(dtype), padding=padding, ops=sorted(ops))
    assert not any("math" in op for op in ops), ops
    others = {"flash", "efficient", "cudnn"} - {kernel}
    assert any(kernel in op for op in ops) and not any(o in op for op in ops for o in others), ops


def test_cudnn_takes_aligned_prefixes_flash_the_others():
    """A chunk whose prefix is a multiple of ``CUDNN_ALIGN`` takes cuDNN's form, its length padded to one (a ragged
    last chunk too); one after another prefix takes flash (cuDNN would build a plan for each such shape). On compute
    capability 9.0+."""
    if not cudnn_usable(torch.device("cuda"), torch.bfloat16, 64):
        pytest.skip("cuDNN's form is not taken on this GPU")
    model = tiny_causal_lm("qwen3", **WIDE).to("cuda", torch.bfloat16)
    ragged = _sdpa_ops(enable_streambp(model, stream_chunk_size=256, verify=False), batch(1, 1000, padding="none"))
    disable_streambp(model)
    unaligned = _sdpa_ops(enable_streambp(model, stream_chunk_size=200, verify=False), batch(1, 1000, padding="none"))
    _report(test="cudnn_alignment", chunk_256=sorted(ragged), chunk_200=sorted(unaligned))
    assert any("cudnn" in op for op in ragged) and not any("flash" in op for op in ragged), ragged
    assert any("cudnn" in op for op in unaligned) and any("flash" in op for op in unaligned), unaligned


def test_cudnn_attention_on_hopper():
    """On compute capability 9.0+ the cuDNN form is taken (its check passes) and, at Qwen3-8B's head shapes
    (32 query heads, 8 key/value heads of 128), its output and input gradients are as close to a float64 reference
    as flash's bottom-right causal SDPA (PyTorch's own kernel for this mask), several key/value heads per call."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is chosen on compute capability 9.0+ only")
    assert cudnn_usable(torch.device("cuda"), torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk, prefix = 512, 1536
    q = torch.randn(1, 32, chunk, 128, device="cuda", generator=g)
    k, v = (torch.randn(1, 8, prefix + chunk, 128, device="cuda", generator=g) for _ in range(2))
    grad = torch.randn(1, 32, chunk, 128, device="cuda", generator=g)
    mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool, device="cuda").tril(prefix)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [t.double() for t in (out, *torch.autograd.grad(out, leaves, grad.to(dtype)))]

    def plain(a, b, c):
        return F.scaled_dot_product_attention(a, b.repeat_interleave(4, 1), c.repeat_interleave(4, 1), attn_mask=mask)

    def flash_lower_right(a, b, c):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            bias = causal_lower_right(chunk, prefix + chunk)
            return F.scaled_dot_product_attention(a, b, c, attn_mask=bias, enable_gqa=True)

    def cudnn_form(a, b, c):
        return cuda._fused_attention("cudnn", a, b, c, None, None, 0.0, None)

    reference, flash, cudnn = (
        run(plain, torch.float64),
        run(flash_lower_right, torch.bfloat16),
        run(cudnn_form, torch.bfloat16),
    )
    per_call = cuda.cudnn_kv_heads(8, 4)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    errors = {n: (rel(c, r), rel(f, r)) for n, c, f, r in zip("oqkv", cudnn, flash, reference, strict=True)}
    _report(test="cudnn_attention", per_call=per_call, errors=errors, device=torch.cuda.get_device_name())
    for name, (err, flash_err) in errors.items():
        assert err <= 2 * flash_err + SLACK[torch.bfloat16], (name, err, flash_err)


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events)


def _overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]], gap: float = 0.0) -> float:
    """Total length of ``spans`` covered by the union of ``busy`` (both lists of (start, end)), ``busy`` intervals
    less than ``gap`` apart joined (the stream is at work between them)."""
    merged: list[list[float]] = []
    for start, end in busy:
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = 0.0
    for start, end in spans:
        for b_start, b_end in merged:
            if b_start >= end:
                break
            total += max(0.0, min(end, b_end) - max(start, b_start))
    return total


def test_offload_copies_overlap_compute():
    """The saved layer inputs' copies (device to host in forward, back in backward) run on a side stream, and the
    compute stream does not wait for them: in a profiler trace of a step, the time the compute stream sat with a
    kernel launched but not started while a copy ran (:func:`trace_waits.copy_waits`) is at most one copy's length
    (the first layer backward needs: no layer ahead of it hides its fetch). Fetched without the one-layer-ahead
    prefetch, each backward layer would wait for its copy. How much copy time falls inside the compute stream's work
    is reported too: in this launch-bound small step much of it falls in gaps the host leaves between kernels (28%
    inside kernels joined across gaps under 100 us on an H200, 2026-11-27), while Qwen3-8B's 16k step took 1.049x the
    time without offload (benchmarks/gpu_nvidia_h200.md)."""
    overrides = dict(hidden_size=2048, intermediate_size=8192, head_dim=128, num_attention_heads=16,
                     num_key_value_heads=8, num_hidden_layers=4, layer_types=["full_attention"] * 4,
                     vocab_size=4096)  # fmt: skip
    seq_len = 8192
    model = enable_streambp(
        tiny_causal_lm("qwen3", **overrides).to("cuda", torch.bfloat16),
        stream_chunk_size=2048,
        offload_checkpoints=True,
        verify=False,
    )
    ids = torch.randint(3, 4096, (1, seq_len), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]  # launches: the CPU's
    with torch.profiler.profile(activities=activities) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    streams: dict[int, int] = {}
    for e in kernels:
        streams[e["args"]["stream"]] = streams.get(e["args"]["stream"], 0) + 1
    compute = max(streams, key=streams.get)
    layer_input = seq_len * overrides["hidden_size"] * 2  # bytes of one saved layer input
    big = [e for e in events if e.get("cat") == "gpu_memcpy" and e["args"].get("bytes", 0) >= layer_input // 2]
    to_host = [e for e in big if "DtoH" in e["name"]]
    to_device = [e for e in big if "HtoD" in e["name"]]
    busy = _intervals([e for e in kernels if e["args"]["stream"] == compute])
    copies = _intervals(to_host + to_device)
    copy_time = sum(end - start for start, end in copies)
    overlapped = _overlap(copies, busy) / copy_time if copy_time else 0.0
    in_work = _overlap(copies, busy, gap=100.0) / copy_time if copy_time else 0.0
    copy_streams = {e["args"]["stream"] for e in to_host + to_device}
    compute_time = sum(end - start for start, end in busy)
    waits = copy_waits(events, compute, copies)
    longest = max((end - start for start, end in copies), default=0.0)
    _report(test="offload_overlap", copies=len(copies), copy_ms=copy_time / 1e3, compute_ms=compute_time / 1e3,
            overlapped=overlapped, in_work=in_work, compute_stream=compute, copy_streams=sorted(copy_streams),
            waited_ms=waits["waited"] / 1e3, host_bound_ms=waits["host_bound"] / 1e3,
            longest_copy_ms=longest / 1e3)  # fmt: skip
    assert len(to_host) >= overrides["num_hidden_layers"] - 1 and to_device, (len(to_host), len(to_device))
    assert compute not in copy_streams, (compute, copy_streams)
    assert waits["waited"] <= longest, f"the compute stream waited {waits['waited']:.0f} us for copies"


@pytest.mark.parametrize(("model_name", "seq_len", "chunk"), [("qwen3-4b", 16384, 4096), ("qwen3-8b", 32768, 4096)])
def test_peak_memory_within_5_percent_of_the_model(model_name, seq_len, chunk):
    """Random weights in bfloat16, full fine-tuning, parameter gradients allocated before the measured step (as the
    memory model counts them), the ``fused_lm_head=True`` call of TRL's trainers."""
    from streambp_trl.bench.models import build_model

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # anything an earlier test left behind is not this step's
    shape = mm.ModelShape.from_name(model_name)
    setup = mm.StepSetup(mode="stream", chunk=chunk, logits_chunk=chunk)
    estimate = mm.estimate_peak_bytes(shape, setup, seq_len)  # two-node: the least the step may take
    if estimate > 0.9 * torch.cuda.get_device_properties(0).total_memory:
        pytest.skip(f"{model_name} at {seq_len} tokens needs about {mm.gib(estimate):.0f} GiB")
    model = enable_streambp(
        build_model(model_name, "bfloat16", "cuda", 0), stream_chunk_size=chunk, logits_chunk_size=chunk, verify=False
    )
    ids = torch.randint(0, shape.vocab, (1, seq_len), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids, fused_lm_head=True, use_cache=False).loss.backward()

    step()  # allocates the parameter gradients, which stay (accumulated into) for the measured step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    form = last_head_form(model)  # the logit kernel's gradient form the engine chose for the free memory
    plan = last_plan(model)  # (kept keys/values where the free memory holds them)
    assert plan.layout == Layout() and not plan.offload, plan  # what the estimate sizes: every input on the device
    capture = plan.kv_mode == "capture"
    estimate = mm.estimate_peak_bytes(shape, dataclasses.replace(setup, head_form=form, kv_mode=plan.kv_mode), seq_len)
    error = abs(peak - estimate) / peak
    _report(test="memory_model", model=model_name, seq_len=seq_len, chunk=chunk, head_form=form, capture=capture,
            peak_gib=mm.gib(peak), estimate_gib=mm.gib(estimate), error=error,
            device=torch.cuda.get_device_name())  # fmt: skip
    assert error <= 0.05, f"measured {mm.gib(peak):.3f} GiB, the memory model {mm.gib(estimate):.3f} GiB"
