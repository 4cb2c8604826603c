"""Recurrent and convolution mixers streamed exactly: Gated DeltaNet, Mamba2, Mamba v1 and MiniMax's lightning
attention (both continued from the chunk's state, :mod:`streambp_trl.layers.continued`) and short-convolution layers,
and Zamba's and Zamba2's hybrid layers (a Mamba decoder layer inside each, beside a shared attention block); the
mixers that no chunk can continue are refused by name when the engine is enabled.

A chunk of such a layer takes from the earlier positions only the states at its start (the recurrent state and the
convolution's last inputs), which it receives through transformers' cache interface; in backward the chunks run last
to first and each hands the gradient of the states it received back to the chunk before
(:class:`streambp_trl.layers.carry.LayerCarry`). One-layer models check that carry alone against plain autograd,
in float64 (the layers' float32 internals computed in float64 too, :class:`Float64Internals`, so the bound is
1e-10), and fail when the carry's gradient is dropped.
"""

import copy
import functools

import pytest
import torch
from helpers import EXACT, LengthReward, assert_same_training, load_tokenizer, tiny_dataset
from model_support import Float64Internals, relative_errors, streamed_error
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from zoo import batch, tiny_causal_lm

from streambp_trl import (
    StreamDPOConfig,
    StreamDPOTrainer,
    StreamGRPOConfig,
    StreamGRPOTrainer,
    StreamSFTConfig,
    StreamSFTTrainer,
    enable_streambp,
)
from streambp_trl.layers import carry

ONE_LAYER = {
    "gated_deltanet": ("qwen3_5_text", {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}),
    "mamba2": ("mamba2", {"num_hidden_layers": 1}),
    "mamba": ("mamba", {"num_hidden_layers": 1}),
    "lightning": ("minimax", {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}),
    "short_conv": ("lfm2", {"num_hidden_layers": 1, "layer_types": ["conv"]}),
}
HYBRIDS = [
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "nemotron_h",
    "lfm2",
    "granitemoehybrid",
    "kimi_linear",
    "zamba2",
    "mamba",
    "falcon_mamba",
    "jamba",
    "zamba",
    "minimax",
]
# Zamba2 with its attention block shared by two of three hybrid layers (num_mem_blocks=2), per-layer adapters on the
# shared block and rotary embeddings: the layout of the released checkpoints
ZAMBA2_SHARED = {
    "num_hidden_layers": 4,
    "layers_block_type": ["linear_attention", "hybrid", "hybrid", "hybrid"],
    "hybrid_layer_ids": [1, 2, 3],
    "num_mem_blocks": 2,
    "use_shared_attention_adapter": True,
    "use_mem_rope": True,
}
# families whose token mixing no chunk can continue from what the previous chunk left, and what the refusal says
REFUSED = {
    "git": "does not go through transformers' AttentionInterface \\(GitSelfAttention adds the mask to its scores",
}


def _float64_model(family: str, **overrides):
    """The zoo's tiny ``family`` model, built with float64 as the default dtype, so that buffers computed at
    construction (the lightning attention's decays) are float64 too, not float32 values cast up."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return tiny_causal_lm(family, **overrides)
    finally:
        torch.set_default_dtype(default)


def _error(reference, streamed, padding: str) -> float:
    return streamed_error(reference, streamed, *batch(padding=padding), Float64Internals)[0]


@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize("chunk", [1, 5, 23])
@pytest.mark.parametrize("mixer", ONE_LAYER)
def test_one_mixer_layer_carries_its_state_exactly(mixer, chunk, padding):
    family, overrides = ONE_LAYER[mixer]
    reference = _float64_model(family, **overrides)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    assert _error(reference, streamed, padding) < EXACT


@pytest.mark.parametrize("mixer", ONE_LAYER)
def test_dropping_the_carry_gradient_is_caught(monkeypatch, mixer):
    """The same check, with the gradient of each chunk's incoming states thrown away: it must fail."""
    family, overrides = ONE_LAYER[mixer]
    reference = _float64_model(family, **overrides)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    absorb = carry.LayerCarry.absorb

    def dropped(self, cache, n, grads):
        absorb(self, cache, n, grads)
        self.state_grads[n] = {}

    monkeypatch.setattr(carry.LayerCarry, "absorb", dropped)
    assert _error(reference, streamed, "right") > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", ["recompute", "capture"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_models_are_exact(family, kv_mode):
    reference = _float64_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, kv_mode=kv_mode)
    assert _error(reference, streamed, "left") < EXACT


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 5])
def test_zamba2_shared_blocks_stream_exactly(chunk, padding):
    """Each hybrid layer's Mamba2 decoder layer (a checkpointed layer inside the streamed one) runs on the chunk
    against the chunk's cache, and the shared block's attention gets the chunk's mask (its ``causal_mask``)."""
    reference = tiny_causal_lm("zamba2", **ZAMBA2_SHARED)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    assert _error(reference, streamed, padding) < EXACT


@pytest.mark.parametrize("family", REFUSED)
def test_mixers_no_chunk_can_continue_are_refused_by_name(family):
    model = tiny_causal_lm(family)
    refusal = f"^StreamBP cannot train {type(model).__name__} exactly: .*{REFUSED[family]}"
    with pytest.raises(ValueError, match=refusal):
        enable_streambp(model, stream_chunk_size=5)


def test_hybrid_generation_uses_the_models_own_cache():
    model = enable_streambp(tiny_causal_lm("qwen3_5_text", dtype=torch.float32), stream_chunk_size=5)
    plain = tiny_causal_lm("qwen3_5_text", dtype=torch.float32)
    ids = batch(padding="none")[0][:1, :8]
    for m in (model, plain):
        m.eval()
    expected = plain.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    model.train()
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


def _tiny_hybrid(family: str):
    """A float64 ``family`` model (the zoo's tiny config) over the tiny tokenizer's vocabulary, the same weights on
    every call."""
    tokenizer = load_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    model = tiny_causal_lm(family, vocab_size=len(tokenizer), **special)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


TRAINERS = {
    "sft": ((SFTTrainer, SFTConfig), (StreamSFTTrainer, StreamSFTConfig), "chat", {}),
    "dpo": ((DPOTrainer, DPOConfig), (StreamDPOTrainer, StreamDPOConfig), "preference", {"ref_model": True}),
    "grpo": (
        (GRPOTrainer, GRPOConfig),
        (StreamGRPOTrainer, StreamGRPOConfig),
        "prompt_completion",
        dict(num_generations=4, max_completion_length=8, temperature=0.7, rewards=lambda: [LengthReward()]),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize(
    "family", ["qwen3_5_text", "qwen3_5_moe_text", "nemotron_h", "mamba", "jamba", "minimax", "deepseek_v4"]
)
def test_trainers_on_hybrids_equal_trl(tmp_path, family, trainer):
    """One SGD step (lr 1) of TRL's trainer and ours on a tiny hybrid: the same update (relative error < 1e-5 per
    parameter) and metrics; GRPO generates through the model's own cache and samples the same completions.

    In float64, with the layers' float32 internals in float64 too (:class:`Float64Internals`): in float32 the gated
    recurrences' exponentials amplify the rounding of a chunked run past 1e-5 on a few parameters (A_log, dt_bias:
    about 3e-5 against float64, where the unchunked run is 5e-6), while the math, checked here, is the same."""
    trl_pair, stream_pair, data, options = TRAINERS[trainer]
    dataset = tiny_dataset(data, 8)
    if trainer == "grpo":
        dataset = dataset.remove_columns("completion")
    model = functools.partial(_tiny_hybrid, family)
    if family in ("qwen3_5_moe_text", "jamba", "minimax", "deepseek_v4"):  # MoE: the load-balancing loss is refused
        options = {**options, "router_aux_loss_coef": 0.0}
    with Float64Internals():
        ref, ours = assert_same_training(trl_pair, stream_pair, tmp_path, dataset, model=model, **options)
    if trainer == "grpo":
        completions = ours.reward_funcs[0].seen
        assert completions == ref.reward_funcs[0].seen and len(set(completions)) > 1


def test_a_kept_convolution_tail_holds_only_its_own_bytes():
    """A chunk's outgoing convolution tail is a view of its whole joined convolution input ((chunk + kernel) x
    conv_dim): the carry store keeps a copy of the kernel's inputs, not the view that would hold that buffer."""
    from streambp_trl.layers.carry import CarryStore

    joined = torch.randn(2, 8, 20)
    store = CarryStore(20)
    store.record(0, {("conv", 0, 0): joined[..., -4:]})
    kept = store.states[("conv", 0, 0)][1]
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    assert torch.equal(kept, joined[..., -4:])


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "jamba", "minimax"])
def test_rows_packed_by_position_ids_stream_as_the_model_runs_them(family):
    """Two documents packed in each row by position ids that restart (no attention mask, no flash-attention sequence
    descriptors): the attention layers keep the documents apart (transformers' packed-sequence mask) while the
    recurrent layers run across the boundary, as the model itself does; the streamed loss and gradient equal plain
    autograd's, and the packing changes the loss (so the comparison sees it)."""
    reference = _float64_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    ids = batch(padding="none")[0][:, :12]
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]).expand(ids.shape[0], -1)

    def loss(model, **kwargs):
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    with Float64Internals():
        ref_loss = loss(reference, position_ids=positions)
        ref_loss.backward()
        streamed_loss = streamed(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
        streamed_loss.backward()
        unpacked = loss(reference).item()
    assert abs(streamed_loss.item() - ref_loss.item()) / ref_loss.item() < EXACT
    assert relative_errors(reference, streamed)[0] < EXACT
    assert abs(unpacked - ref_loss.item()) > 1e-6


def test_a_mamba_scan_whose_last_state_has_no_gradient_still_carries_it(monkeypatch):
    """mamba-ssm's selective-scan kernel returns its last state without a gradient. With the model's scan made so
    (its last state detached), the one-layer Mamba model still streams exactly: the continued scan recomputes the
    chunk's zero-started last state itself under grad (:mod:`streambp_trl.layers.continued.mamba_scan`)."""
    from transformers.models.mamba import modeling_mamba

    scan = modeling_mamba.mamba_selective_scan

    def kernel_like(*args, return_last_state=False, **kwargs):
        out = scan(*args, return_last_state=return_last_state, **kwargs)
        return (out[0], out[1].detach()) if return_last_state else out

    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", kernel_like)
    family, overrides = ONE_LAYER["mamba"]
    reference = _float64_model(family, **overrides)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert _error(reference, streamed, "right") < EXACT


def test_a_continued_scan_leaves_another_threads_model_alone():
    """The continued Mamba scan is rebound in the modeling module for a chunk call: a plain Mamba model running in
    another thread meanwhile gets the model's own scan (the same logits as alone)."""
    import threading

    streamed = enable_streambp(tiny_causal_lm("mamba", dtype=torch.float32), stream_chunk_size=5)
    other = tiny_causal_lm("mamba", dtype=torch.float32, seed=3).eval()
    ids, mask, labels = batch(padding="none")
    with torch.no_grad():
        expected = other(input_ids=ids, use_cache=False).logits
    inside, release, calls = threading.Event(), threading.Event(), []

    def hold_in_second_chunk(module, args):
        calls.append(None)
        if len(calls) == 2:  # the second chunk's forward, with the scan rebound
            inside.set()
            release.wait(30)

    streamed.backbone.layers[0].mixer.in_proj.register_forward_pre_hook(hold_in_second_chunk)
    step = threading.Thread(target=lambda: streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward())
    step.start()
    try:
        assert inside.wait(30)
        with torch.no_grad():
            got = other(input_ids=ids, use_cache=False).logits
    finally:
        release.set()
        step.join()
    assert torch.equal(got, expected)
