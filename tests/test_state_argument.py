"""A decoder layer that takes its recurrent state as an argument and returns its last state beside its output, with no
cache (xLSTM's mLSTM blocks: ``forward(x, state) -> (y, (C, n, m))``), streamed exactly.

Each chunk's state enters through that argument, served by the chunk cache
(``adapters.state_argument.state_argument_run``): the cell state C (heads x d_qk x d_v), the normaliser n and the
stabiliser m the previous chunk left, as leaves with gradient in backward, whose gradient goes back to that chunk. Tiny
float64 xLSTM models against plain autograd (relative error <= 1e-10): right, left and no padding, chunks of one token,
chunks that do not divide the length, and chunks across the mLSTM kernel's own 64-token blocks. The comparison fails
when the states' gradient is dropped, and a chunk that starts from a zero state is refused at enable."""

import copy

import pytest
import torch
from model_support import Float64Internals, streamed_error
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.layers.adapters import state_argument

EXACT = 1e-10


def _error(chunk: int, padding: str, rows: int = 2, seq_len: int | None = None) -> float:
    reference = tiny_causal_lm("xlstm")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    inputs = batch(rows, seq_len, padding=padding) if seq_len else batch(padding=padding)
    return streamed_error(reference, streamed, *inputs, Float64Internals)[0]


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_xlstm_states_are_carried_exactly(chunk, padding):
    assert _error(chunk, padding) < EXACT


@pytest.mark.parametrize("chunk", [50, 100])
def test_xlstm_chunks_across_its_kernel_blocks(chunk):
    """300 tokens: the mLSTM kernel runs 64-token blocks, then a step-by-step remainder, in each chunk and in the
    plain call alike, from different starting positions."""
    assert _error(chunk, "left", seq_len=300) < EXACT


def test_the_states_gradient_must_reach_the_earlier_chunk(monkeypatch):
    """The incoming states served without gradient: the forward is unchanged (enable's probe passes), and the
    gradient is wrong."""
    run = state_argument.state_argument_run

    def detached(func, layer, x, *, state, **kwargs):
        get = state.get_recurrent_state
        monkeypatch.setattr(
            state, "get_recurrent_state", lambda i, j=0: None if (t := get(i, j)) is None else t.detach()
        )
        return run(func, layer, x, state=state, **kwargs)

    monkeypatch.setattr(state_argument, "state_argument_run", detached)
    assert _error(5, "right") > 1e-3


def test_a_chunk_from_a_zero_state_is_refused(monkeypatch):
    run = state_argument.state_argument_run

    def fresh(func, layer, x, *, state, **kwargs):
        monkeypatch.setattr(state, "get_recurrent_state", lambda i, j=0: None)
        return run(func, layer, x, state=state, **kwargs)

    monkeypatch.setattr(state_argument, "state_argument_run", fresh)
    with pytest.raises(ValueError, match="different result when streamed chunk by chunk"):
        enable_streambp(tiny_causal_lm("xlstm"), stream_chunk_size=4)


def test_greedy_generation_in_training_mode_is_the_models_own():
    """xLSTM builds its cache in generation's first call (``use_cache=True``, no cache given): without grad that call
    is the model's own, so later steps continue from its states. A streamed training call, whose blocks return
    ``None`` for the state the model's loop unpacks, trains after it."""
    reference = tiny_causal_lm("xlstm")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch(1, 12, padding="none")
    generated = []
    for m in (reference, model):
        m.train()
        with torch.no_grad():
            generated.append(m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    assert torch.equal(*generated)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_the_sft_trainer_trains_the_models_own_capped_logits(tmp_path, caplog):
    """xLSTM caps its logits (``output_logit_soft_cap``), which TRL's fused LM head does not read: StreamSFTTrainer
    trains the model's own loss, says so at construction, and its step's loss is the plain model's on that batch."""
    from helpers import args, load_tokenizer, tiny_dataset

    from streambp_trl import StreamSFTConfig, StreamSFTTrainer

    tokenizer = load_tokenizer()
    model = tiny_causal_lm("xlstm", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    plain = copy.deepcopy(model)
    with caplog.at_level("WARNING", logger="streambp_trl.trainers.mixin"):
        trainer = StreamSFTTrainer(
            model=model,
            args=args(StreamSFTConfig, tmp_path),
            train_dataset=tiny_dataset("chat", 4),
            processing_class=tokenizer,
        )
    assert (
        "(model)" in caplog.text
        and "output_logit_soft_cap" in caplog.text
        and "TRL's own trainer differs" in caplog.text
    )
    inputs = next(iter(trainer.get_train_dataloader()))
    with Float64Internals():
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        labels = inputs["labels"] if "labels" in inputs else inputs["input_ids"]
        expected = plain(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels).loss
    assert abs(loss.item() - expected.item()) < 1e-10 * abs(expected.item())


def test_its_own_eval_loop_over_long_sequences_runs_as_it_is():
    """In eval xLSTM runs a sequence longer than ``max_inference_chunksize`` piece by piece itself, without grad,
    handing each block the state the last piece left: with ``stream_eval`` those calls give a state, and run the
    block as it is (as a call with a real cache does). The logits equal the plain model's called as the engine calls
    the decoder, without a cache (``use_cache=False``: the model's loop then keeps the states in a float32 cache of
    its own, where a call with ``use_cache=True`` keeps them in the model's dtype)."""
    reference = tiny_causal_lm("xlstm", max_inference_chunksize=8)
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, stream_eval=True)
    ids = batch(1, 20, padding="none")[0]
    logits = []
    for m in (reference, model):
        m.eval()
        with torch.no_grad():
            logits.append(m(input_ids=ids, use_cache=False).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)


def test_a_state_argument_the_layer_does_not_return_is_refused():
    """A layer that takes ``state`` but returns its output alone: its state could not be carried, and unpacking the
    output as ``(y, state)`` would split a batch of two. Refused, with the reason."""
    from streambp_trl.layers.carry import CarryStore, ChunkCache

    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="takes `state` but does not return"):
        state_argument.state_argument_run(
            lambda layer, x, state=None: x, torch.nn.Identity(), x, state=ChunkCache(CarryStore(3), start=0)
        )
