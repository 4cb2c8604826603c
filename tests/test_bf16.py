"""bfloat16 training, in each form (autocast on float32 weights; bfloat16 weights; padded and unpadded batches), on
every attention path of the stream attention (bottom-right causal, masked, sliding window, attention sinks, and the
CUDA path run on the CPU), against plain autograd in the same precision.

bfloat16 results cannot agree to float64 rounding, so both are measured against a float64 reference (the same
weights in float64, no autocast): the streamed loss and each parameter's gradient must be as close to it as the plain
model's are, up to a factor 2 and one bfloat16 epsilon (``2**-7``, relative) for gradients (a tensor of a few
elements, such as the attention sinks, has a noisy relative error); the loss is a mean over the tokens, whose
bfloat16 errors average out, so its slack is ``1e-4``. A wrong gradient (a missing prefix term, a mask
off by one) is off by far more; a precision bug (a path computing in a lower precision than the plain model)
shows as a factor.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from helpers import tiny_dataset, train
from model_support import Float64Internals
from models import batch, tiny_model
from trl import SFTConfig, SFTTrainer
from zoo import tiny_causal_lm

from streambp_trl import StreamSFTConfig, StreamSFTTrainer, enable_streambp
from streambp_trl.attention import cuda, grouped, kernels
from streambp_trl.attention.causal_chunk import CPU_FLASH

GRAD_SLACK = torch.finfo(torch.bfloat16).eps  # 2**-7, relative
LOSS_SLACK = 1e-4
CHUNKS = (5, 8)  # neither divides the length (23)

# path -> (family, padding): "none" keeps every layer call plainly causal (bottom-right SDPA)
PATHS = {
    "lower_right": ("llama", "none"),
    "lower_right_qk_norm": ("qwen3", "none"),
    "masked_right": ("llama", "right"),
    "masked_left_qk_norm": ("qwen3", "left"),
    "sliding_window": ("mistral", "none"),  # window 5 < 23 tokens
    "sliding_window_padded": ("mistral", "right"),
    "sinks": ("gpt_oss", "none"),  # sinks on sliding and full attention layers
    "sinks_padded": ("gpt_oss", "right"),
    "gated_deltanet": ("qwen3_5_text", "right"),  # per-head vectors (dt_bias, A_log) summed over every position
    "mamba2": ("nemotron_h", "left"),
    "mamba_v1_continued_scan": ("jamba", "left"),
    "lightning_continued": ("minimax", "left"),
}
FORMS = ("autocast_fp32", "bf16_weights")


def _weights(family: str, form: str, **overrides) -> torch.nn.Module:
    dtype = torch.float32 if form == "autocast_fp32" else torch.bfloat16
    if family in ("gpt_oss", "qwen3_5_text", "nemotron_h", "jamba", "minimax"):
        return tiny_causal_lm(family, dtype=dtype, **overrides)
    return tiny_model(family, dtype, **overrides)


def _step(model: torch.nn.Module, inputs: tuple, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and parameter gradients (in float64) of one forward/backward, under bfloat16 autocast or not."""
    ids, mask, labels = inputs
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _errors(result: tuple, reference: tuple) -> dict[str, float]:
    """Relative error of the loss and of each parameter's gradient against the float64 reference."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert grads.keys() == ref_grads.keys()
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errors[name] = ((grads[name] - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    return errors


@functools.cache
def _baseline(family: str, padding: str, form: str, **overrides) -> tuple[torch.nn.Module, dict, dict]:
    """The model in ``form``, the plain model's errors against float64, and the float64 step (shared by chunks)."""
    model = _weights(family, form, **overrides)
    inputs = batch(2, 23, padding=padding)
    reference = _step(copy.deepcopy(model).double(), inputs, autocast=False)
    plain = _errors(_step(copy.deepcopy(model), inputs, form == "autocast_fp32"), reference)
    return model, plain, reference


def _assert_as_close_as_plain(streamed: dict[str, float], plain: dict[str, float]) -> None:
    for name, err in streamed.items():
        slack = LOSS_SLACK if name == "loss" else GRAD_SLACK
        assert err <= 2 * plain[name] + slack, f"{name}: streamed error {err:.2e}, plain bf16 error {plain[name]:.2e}"


def _check(family: str, padding: str, form: str, chunk: int, **overrides) -> None:
    model, plain, reference = _baseline(family, padding, form, **overrides)
    streamed = enable_streambp(copy.deepcopy(model), stream_chunk_size=chunk, logits_chunk_size=5, verify=False)
    errors = _errors(_step(streamed, batch(2, 23, padding=padding), form == "autocast_fp32"), reference)
    _assert_as_close_as_plain(errors, plain)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("path", PATHS)
def test_bf16_streamed_is_as_exact_as_plain(path, form, chunk):
    family, padding = PATHS[path]
    _check(family, padding, form, chunk)


@pytest.mark.parametrize("seed", [0, 3])
def test_bf16_recurrent_per_head_vectors_as_exact_as_plain(seed):
    """Gated DeltaNet's per-head vectors (``dt_bias``, ``A_log``) take a gradient summed over every position whose
    terms nearly cancel: over 515 tokens the chunks' sums are far larger than the total, and rounding each to
    bfloat16 before adding them made ``dt_bias``'s error several times the plain step's. The engine sums such vectors
    in float32. The reference keeps the layer's float32 internals in float64 (the cancellation shows at float32
    rounding too)."""
    model = tiny_causal_lm("qwen3_5_text", seed=seed)
    ids, mask, labels = batch(2, 515, padding="right", seed=seed + 1)

    def step(m: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        loss = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.item(), {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}

    with Float64Internals():
        reference = step(copy.deepcopy(model))
    plain = _errors(step(copy.deepcopy(model).to(torch.bfloat16)), reference)
    streamed = enable_streambp(copy.deepcopy(model).to(torch.bfloat16), stream_chunk_size=64, logits_chunk_size=96)
    _assert_as_close_as_plain(_errors(step(streamed), reference), plain)


def _cuda_path_on_cpu(module, query, key, value, block, sinks, scaling, dropout, prefix):
    """The CUDA attention for CPU tensors: PyTorch's CPU build has a flash kernel (bfloat16 included), not the
    memory-efficient one, so plainly causal chunks only."""
    assert block is None and sinks is None, "the CPU has no memory-efficient kernel: only plainly causal chunks here"
    return cuda.cuda_attention(module, query, key, value, block, sinks, scaling, dropout, prefix)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_bf16_cuda_attention_path_is_as_exact_as_plain(monkeypatch, kernel, heads, kv_heads, form, chunk):
    """Flash attention with grouped heads one group at a time, or the cuDNN form (prefix and diagonal block merged in
    float32, the CPU's flash kernel in cuDNN's place); the prefix's key/value gradient added straight into the
    layer's sums (through the autocast cast of the joined keys/values)."""
    prefixes = []
    apply = grouped._GroupedHeads.apply

    def counted(query, key, value, attend, prefix, per_call=1):
        prefixes.append(prefix is not None)
        return apply(query, key, value, attend, prefix, per_call)

    monkeypatch.setattr(kernels, "_cpu_attention", _cuda_path_on_cpu)
    monkeypatch.setattr(grouped._GroupedHeads, "apply", counted)
    if kernel == "cudnn":
        monkeypatch.setattr(cuda, "cudnn_usable", lambda device, dtype, head_dim: True)
        monkeypatch.setattr(cuda, "CUDNN", CPU_FLASH)
        monkeypatch.setattr(cuda, "CUDNN_ALIGN", 1)
    _check("qwen3", "none", form, chunk, num_attention_heads=heads, num_key_value_heads=kv_heads)
    assert any(prefixes) == (kv_heads < heads or kernel == "cudnn")


def _train_one_step(trainer_cls, config_cls, tmp_path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One bf16 step on a single row (:func:`helpers.train`): the logged losses and the update."""
    overrides = dict(bf16=True, per_device_train_batch_size=1, learning_rate=0.1)
    trainer, update = train(trainer_cls, config_cls, tmp_path, tiny_dataset("chat", 4), **overrides)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], update


def test_stream_sft_trainer_trains_bf16_on_float32_weights(tmp_path):
    """TRL's default ``bf16=True`` on float32 weights is autocast; one unpadded sequence per batch takes the
    bottom-right causal path. The step agrees with SFTTrainer's to bfloat16 noise."""
    ref_losses, ref_update = _train_one_step(SFTTrainer, SFTConfig, tmp_path)
    losses, update = _train_one_step(StreamSFTTrainer, StreamSFTConfig, tmp_path)
    assert len(losses) == len(ref_losses) == 1
    assert abs(losses[0] - ref_losses[0]) <= 1e-3 * abs(ref_losses[0])
    assert update.keys() == ref_update.keys()
    flat = torch.cat([update[n].flatten() for n in ref_update])
    ref_flat = torch.cat([ref_update[n].flatten() for n in ref_update])
    assert torch.isfinite(flat).all()
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 2e-2
