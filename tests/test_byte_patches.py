"""BLT streamed exactly: a byte stack, a patch stack and a byte stack again, with whole-sequence cross-attention
between them.

Every ``BltTransformerLayer`` call is streamed along its own sequence (bytes in the local encoder and decoder, patches
in the global transformer, bytes in the entropy patcher, which runs without gradient). The cross-attention modules
between the stacks (patches attending to their bytes, bytes to the patches before theirs) are not decoder layers:
they run on the whole sequence as in the plain model, through the stream attention with the dense patch mask the
model builds (every key it covers may be attended, none later), and autograd takes their gradient as it does the
plain model's.

In float64 (the float32 norms computed in float64, :class:`Float64Internals`) every parameter's gradient must agree
with plain autograd to 1e-10 relative: right, left and no padding, patches of up to four bytes, chunks of 1, 5 and
23 tokens. The local encoder's cross-attention query and key projections get a gradient that is zero in exact
arithmetic (the plain model's own is 3e-17 against a largest parameter gradient of 1.2 here), so each gradient's error
is taken relative to its norm or a millionth of the largest gradient's, whichever is larger.
"""

import copy

import pytest
import torch
from model_support import Float64Internals, plain_loss
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp

EXACT = 1e-10
SEQ_LEN = 40


def _errors(chunk: int, padding: str) -> dict[str, float]:
    reference = tiny_causal_lm("blt", max_patch_length=4)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    ids, mask, labels = batch(seq_len=SEQ_LEN, padding=padding)
    with Float64Internals():
        ref_loss = plain_loss(reference, ids, mask, labels)
        ref_loss.backward()
        loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    params = zip(reference.named_parameters(), streamed.parameters(), strict=True)
    pairs = [(n, p.grad, q.grad) for (n, p), q in params]
    assert all((a is None) == (b is None) for _, a, b in pairs)
    pairs = [(n, a, b) for n, a, b in pairs if a is not None]
    floor = 1e-6 * max(a.norm() for _, a, _ in pairs)
    errors = {n: ((b - a).norm() / torch.maximum(a.norm(), floor)).item() for n, a, b in pairs}
    errors["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return errors


@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_byte_and_patch_stacks_stream_exactly(chunk, padding):
    errors = _errors(chunk, padding)
    worst = max(errors, key=errors.get)
    assert errors[worst] < EXACT, f"{errors[worst]:.2e} at {worst}"


def test_its_whole_sequence_masks_are_warned_at_enable(monkeypatch):
    """The cross-attention masks BLT builds outside its layers are (patches x bytes), patches padded to the bytes: the
    streamed step still holds tensors with two dimensions of the sequence length (seen here), so enabling says so."""
    from helpers import ShapeRecorder

    from streambp_trl.engine import support

    said = []
    monkeypatch.setattr(support.logger, "warning", said.append)
    streamed = enable_streambp(tiny_causal_lm("blt", max_patch_length=4), stream_chunk_size=16)
    assert len(said) == 1 and "_prepare_patch_cross_attention_mask" in said[0] and "not saved" in said[0]
    ids, mask, labels = batch(seq_len=160, padding="right")
    with ShapeRecorder() as shapes:
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert shapes.full_size(160)
