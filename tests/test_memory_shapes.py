"""No (T x T) mask or score tensor and no (tokens x vocab) logits tensor is ever built by the engine."""

import pytest
import torch
from models import VOCAB, batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from trl.trainer.utils import add_fused_lm_head

from streambp_trl import enable_streambp

T, CHUNK, TILE = 96, 8, 8


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _violations(shapes):
    bad = []
    for op, shape in shapes:
        big = [d for d in shape if d >= T - 1]
        if len(big) >= 2:
            bad.append(("T x T", op, shape))
        if VOCAB in shape and any(d >= T // 2 for d in shape if d != VOCAB):
            bad.append(("tokens x vocab", op, shape))
    return bad


def _run(model, **call):
    ids, mask, labels = batch(seq_len=T, padding="left")
    with _Shapes() as rec:
        model(input_ids=ids, attention_mask=mask, labels=labels, **call).loss.backward()
    return _violations(rec.shapes)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("fused", [False, True])
def test_stream_builds_no_full_mask_or_logits(family, fused):
    model = enable_streambp(tiny_model(family, dtype=torch.float32), stream_chunk_size=CHUNK, logits_chunk_size=TILE)
    assert model.config.hidden_size < T // 2  # so the LM head weight (vocab x hidden) is not flagged
    assert _run(model, **({"fused_lm_head": True} if fused else {})) == []


def test_detector_flags_the_stock_model():
    """The check above can fail: stock transformers with padding builds a T x T mask and full logits."""
    kinds = {kind for kind, *_ in _run(tiny_model("qwen3", dtype=torch.float32))}
    assert kinds == {"T x T", "tokens x vocab"}
    model = tiny_model("qwen3", dtype=torch.float32)
    model.activation_checkpointing_enable()
    add_fused_lm_head(model)  # gradient checkpointing still builds the T x T mask
    assert "T x T" in {kind for kind, *_ in _run(model, fused_lm_head=True, use_cache=False)}
