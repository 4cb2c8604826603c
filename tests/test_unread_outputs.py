"""The chunk recompute skips the linear maps whose output no gradient reads (layers.call.unread): which ones
qualify is seen in the layer's own forward, and the skip leaves every gradient exact."""

import contextlib
import copy

import pytest
import torch
from helpers import RECOMPUTED, assert_matches_plain
from models import batch, internals, tiny_model
from torch import nn

from streambp_trl import enable_streambp
from streambp_trl.layers.call import layer_call
from streambp_trl.layers.call.unread import outputs_skipped, unread_outputs


def _unread_names(model, layer_index: int = 0) -> list[str]:
    """The names (in the layer) of the maps :func:`unread_outputs` finds in one no-grad run of a decoder layer."""
    layer = model.model.layers[layer_index]
    x = torch.randn(1, 6, model.config.hidden_size, dtype=next(model.parameters()).dtype)
    positions = torch.arange(6)[None]
    with torch.no_grad(), unread_outputs(layer) as found:
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions))
    names = {id(m): n for n, m in layer.named_modules()}
    return sorted(names[id(m)] for m in found)


def test_only_a_product_that_only_the_residual_reads_qualifies():
    assert _unread_names(tiny_model("llama")) == ["mlp.down_proj"]
    assert _unread_names(tiny_model("qwen3")) == ["mlp.down_proj"]
    # a norm after the MLP (post-norm) and MoE experts weighted by the router read the product's value
    assert _unread_names(tiny_model("olmo2")) == []
    assert _unread_names(tiny_model("qwen3_moe", experts_implementation="eager")) == []


class _ReadsOnHost(nn.Module):
    """A residual block whose code reads its product's value on the host (as an fp16 overflow guard does)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        if torch.isinf(h).any():
            h = h.clamp(-1e4, 1e4)
        return x + h * 0.5


def test_a_value_read_disqualifies():
    block = _ReadsOnHost()
    with torch.no_grad(), unread_outputs(block) as found:
        block(torch.randn(2, 3, 4))
    assert found == []
    guarded = copy.deepcopy(block)
    guarded.forward = lambda x: x + guarded.down(torch.relu(guarded.up(x))) * 0.5
    with torch.no_grad(), unread_outputs(guarded) as found:
        guarded(torch.randn(2, 3, 4))
    assert found == [guarded.down]


@pytest.mark.parametrize("autocast", [False, True])
def test_skipped_product_has_the_plain_gradients(autocast):
    torch.manual_seed(0)
    linear = nn.Linear(16, 24)
    x = torch.randn(2, 5, 16, requires_grad=True)
    dz = torch.randn(2, 5, 24)
    grads = []
    for skip in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), outputs_skipped([linear] if skip else []):
            z = linear(x)
        assert z.dtype == (torch.bfloat16 if autocast else torch.float32)
        grads.append(torch.autograd.grad(z, (x, linear.weight, linear.bias), dz.to(z.dtype)))
    for plain, skipped in zip(*grads, strict=True):
        assert plain.dtype == skipped.dtype
        torch.testing.assert_close(skipped, plain, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_streamed_gradients_stay_exact(family):
    reference = tiny_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    with internals(family):
        assert_matches_plain(reference, streamed, *batch(padding="left"))


def test_lora_on_the_skipped_product_is_exact():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["o_proj", "down_proj"])
    reference = peft.get_peft_model(tiny_model("llama"), config)
    for name, p in reference.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # nonzero, so the adapters change the gradients
    layer = reference.base_model.model.model.layers[0]
    assert layer.mlp.down_proj.base_layer in _lora_unread(reference)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    assert_matches_plain(reference, streamed, *batch(padding="right"))


def _lora_unread(model) -> list[nn.Module]:
    layer = model.base_model.model.model.layers[0]
    rotary = model.base_model.model.model.rotary_emb
    x = torch.randn(1, 6, model.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(6)[None]
    with torch.no_grad(), unread_outputs(layer) as found:
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary(x, positions))
    return found


def test_skipping_a_product_whose_value_is_read_is_caught(monkeypatch):
    """Why the verdict is seen rather than assumed: skipping OLMo 2's down_proj (a norm reads its output) would give
    a wrong gradient, which the plain comparison shows."""
    reference = tiny_model("olmo2")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, **RECOMPUTED)

    @contextlib.contextmanager
    def every_down_proj(layer, carried=tuple):
        yield [layer.mlp.down_proj]

    monkeypatch.setattr(layer_call, "unread_outputs", every_down_proj)
    with pytest.raises(AssertionError, match="relative gradient error"):
        assert_matches_plain(reference, streamed, *batch(padding="left"))
