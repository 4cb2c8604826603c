"""Float64 gradient parity of the stream engine with plain autograd, for every supported family."""

import copy

import pytest
import torch
from helpers import EXACT, RECOMPUTED, assert_matches_plain, max_rel_grad_error
from models import FAMILIES, batch, internals, tiny_model

from streambp_trl import enable_streambp


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_float64(family, padding):
    reference = tiny_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch(padding=padding)
    with internals(family):
        assert_matches_plain(reference, streamed, ids, mask, labels)


@pytest.mark.parametrize("chunk", [1, 5, 7, 22, 23, 64])  # one token, non-dividing, T-1, T, longer than T
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_chunk_sizes(family, chunk):
    reference = tiny_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk, logits_chunk_size=3)
    assert_matches_plain(reference, streamed, *batch(padding="left"))


@pytest.mark.parametrize("kv_mode", ["recompute", "capture"])
def test_kv_modes(kv_mode):
    reference = tiny_model("gemma3", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=3, kv_mode=kv_mode)
    with internals("gemma3"):
        assert_matches_plain(reference, streamed, *batch(padding="right"))


def test_fused_lm_head_call_is_exact():
    reference = tiny_model("qwen2")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=6)
    assert_matches_plain(reference, streamed, *batch(padding="left"), fused_lm_head=True)


def test_tied_embeddings():
    reference = tiny_model("qwen3", tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert_matches_plain(reference, streamed, *batch())


def test_packed_sequences_without_attention_mask():
    """Padding-free packing: sequence boundaries come from position_ids resets, as TRL's padding_free sends them (with
    use_cache=False: a call that builds a cache attends across them, in plain and streamed alike)."""
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, _, labels = batch(batch_size=1, seq_len=21, padding="none")
    position_ids = torch.cat([torch.arange(8), torch.arange(6), torch.arange(7)])[None]
    labels[0, [0, 8, 14]] = -100
    ref_logits = reference(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0, :-1], labels[0, 1:], ignore_index=-100)
    ref_loss.backward()
    loss = streamed(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert max_rel_grad_error(reference, streamed)[0] < EXACT
    # the packing matters: without the position_ids the loss differs
    assert abs(streamed(input_ids=ids, labels=labels).loss.item() - loss.item()) > 1e-6


def test_lora():
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    reference = peft.get_peft_model(base, config)
    for name, p in reference.named_parameters():  # LoRA B starts at zero; make the test see every path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    ids, mask, labels = batch(padding="left")
    assert_matches_plain(reference, streamed, ids, mask, labels)
    trainable = [n for n, p in streamed.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_each_parameter_gets_one_gradient_per_backward():
    """Each trainable parameter's AccumulateGrad fires once per backward (one reduction per layer under DDP/FSDP)."""
    model = enable_streambp(tiny_model("qwen3", num_hidden_layers=3), stream_chunk_size=4)
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
    ids, mask, labels = batch(seq_len=17)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert counts and set(counts.values()) == {1}
    assert set(counts) == {n for n, _ in model.named_parameters()}


def test_float32_matches_plain_autograd():
    reference = tiny_model("llama", dtype=torch.float32)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert_matches_plain(reference, streamed, *batch(padding="left"), tol=1e-5)


def test_bf16_autocast_matches_checkpointing():
    """Under bf16 autocast the recompute in backward runs under the forward's autocast state."""
    reference = tiny_model("qwen3", dtype=torch.float32)
    reference.activation_checkpointing_enable()
    streamed = enable_streambp(tiny_model("qwen3", dtype=torch.float32), stream_chunk_size=5, **RECOMPUTED)
    seen: list[torch.dtype] = []
    streamed.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids, mask, labels = batch(padding="left")
    for model in (reference, streamed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        calls_in_forward = len(seen)
        out.loss.backward()
    assert len(seen) > calls_in_forward and set(seen) == {torch.bfloat16}  # backward recompute ran in bf16 too
    err, where = max_rel_grad_error(reference, streamed)
    assert err < 3e-2, f"{err:.2e} at {where}"


def test_user_given_4d_mask_is_sliced_per_chunk():
    """A ready-made 4D boolean mask (here causal + padding + one blocked pair) is honoured block by block."""
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask2d, labels = batch(padding="left")
    seq = ids.shape[1]
    mask4d = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & mask2d.bool()[:, None, None, :]
    mask4d = mask4d | torch.eye(seq, dtype=torch.bool)  # every row keeps itself, so no row is fully masked
    mask4d[:, :, 15, 3] = False
    ref_logits = reference(input_ids=ids, attention_mask=mask4d, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=mask4d, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= EXACT * ref_loss.item()
    assert max_rel_grad_error(reference, streamed)[0] < EXACT


def test_parameter_tensor_hooks_see_the_whole_gradient_once():
    """A user's tensor hook on a parameter (here one that doubles, one that clamps) runs once, on the parameter's whole
    gradient, as without streaming: not on each chunk's part."""
    reference = tiny_model("qwen3")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    calls = []
    for model in (reference, streamed):
        layer = model.model.layers[0]
        layer.mlp.up_proj.weight.register_hook(lambda g: calls.append(1) or g * 2)
        layer.self_attn.q_proj.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    err = assert_matches_plain(reference, streamed, *batch())
    assert calls == [1, 1] and err < EXACT  # once in the reference, once streamed
