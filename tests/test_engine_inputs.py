"""What a streaming model is given besides a plain batch: pickling it, PEFT prompt learning, ``logits_to_keep``, and
generation in training mode. Each is served exactly as the model without the engine serves it, or refused by name."""

from __future__ import annotations

import copy
import inspect
import pickle

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_layers
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from helpers import MODEL, args, load_tokenizer, max_rel_grad_error, reference_loss, tiny_dataset
from models import VOCAB, batch, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from streambp_trl import StreamSFTConfig, StreamSFTTrainer, disable_streambp, enable_streambp
from streambp_trl.engine import chunk_sizes, is_streaming
from streambp_trl.layers import CheckpointOffload

EXACT = 1e-10


def _exact_step(reference, model, loss_fn) -> None:
    """``loss_fn(m)`` and its gradients agree between ``reference`` (plain autograd) and the streaming ``model``."""
    ref_loss, loss = loss_fn(reference), loss_fn(model)
    ref_loss.backward()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= EXACT * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, model)
    assert err < EXACT, (err, where)


# -- torch.save(model) -------------------------------------------------------------------------------------------


def test_saved_model_loads_streaming_and_exact(tmp_path):
    """torch.save of an enabled model, then torch.load: it streams (exact gradients), keeps the model's signature,
    deep-copies, and disable_streambp gives back the plain model."""
    reference = tiny_model("llama")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, offload_checkpoints=True, keep_every=2)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert is_streaming(loaded)
    state, choices = loaded._streambp, loaded._streambp.options.choices
    assert state == model._streambp  # (the offloader, a runtime object, is not compared)
    assert (state.options.stream_chunk_size, choices.keep_every, type(state.offloader)) == (4, 2, CheckpointOffload)
    assert all(facts.choices == choices for facts in state.facts) and len(state.facts) == len(loaded.model.layers)
    assert loaded.forward.__self__ is loaded and loaded.model.forward.__self__ is loaded.model
    # the HF Trainer drops dataset columns the forward does not take; generate validates its kwargs the same way
    assert inspect.signature(loaded.forward) == inspect.signature(reference.forward)
    ids, mask, labels = batch()
    assert loaded(input_ids=ids, attention_mask=mask, labels=labels).logits is None  # the streamed loss path
    _exact_step(reference, loaded, lambda m: reference_loss(m, ids, mask, labels))

    copied = copy.deepcopy(loaded)
    assert is_streaming(copied) and copied.forward.__self__ is copied
    disable_streambp(loaded)
    assert not any("_streambp_patches" in vars(m) or "forward" in vars(m) for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_saved_model_with_auto_chunks_loads_streaming_and_exact(tmp_path):
    """The "auto" chunk policy (the trainers' default) holds the model weakly: it pickles with the model and chooses
    again after loading."""
    reference = tiny_model("llama")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size="auto")
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    auto = loaded._streambp.auto
    assert is_streaming(loaded) and auto._model() is loaded
    ids, mask, labels = batch()
    _exact_step(reference, loaded, lambda m: reference_loss(m, ids, mask, labels))
    assert chunk_sizes(loaded)[0] == auto.last is not None


@pytest.fixture
def bf16_accelerator():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(mixed_precision="bf16", cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_mixed_precision_wrapper_keeps_signature_and_engine(bf16_accelerator):
    """accelerate's mixed-precision wrapper rebinds ``model.forward.__func__``: the wrapped forward keeps the model's
    signature (generate builds the attention mask only when the forward takes one), and unwrapping it with
    ``keep_fp32_wrapper=False`` gives back the streamed forward, not the class's."""
    reference = tiny_model("llama", dtype=torch.float32)
    model = bf16_accelerator.prepare(enable_streambp(copy.deepcopy(reference), stream_chunk_size=4))
    assert bf16_accelerator.native_amp and "_original_forward" in vars(model)
    assert inspect.signature(model.forward) == inspect.signature(reference.forward)
    ids, mask, labels = batch()
    unwrapped = bf16_accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert inspect.signature(unwrapped.forward) == inspect.signature(reference.forward)
    assert unwrapped(input_ids=ids, attention_mask=mask, labels=labels).logits is None  # still the streamed loss


def test_engine_state_pickles():
    model = enable_streambp(tiny_model("llama"), stream_chunk_size=4, offload_checkpoints=True)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    state = pickle.loads(pickle.dumps(model._streambp))
    assert state.options.choices == model._streambp.options.choices
    assert isinstance(state.offloader, CheckpointOffload)


# -- PEFT prompt learning ----------------------------------------------------------------------------------------


def test_peft_prefix_tuning_is_refused_at_enable():
    model = peft.get_peft_model(
        tiny_model("llama"), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    )
    with pytest.raises(ValueError, match="PEFT prefix tuning .* use LoRA"):
        enable_streambp(model, stream_chunk_size=4)
    assert getattr(model.get_base_model(), "_streambp", None) is None


def test_peft_prefix_tuning_is_refused_at_trainer_construction(tmp_path):
    dataset = tiny_dataset("chat", 4)
    with pytest.raises(ValueError, match="PEFT prefix tuning .* use LoRA"):
        StreamSFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(MODEL),
            args=args(StreamSFTConfig, tmp_path, max_length=64),
            train_dataset=dataset,
            processing_class=load_tokenizer(),
            peft_config=peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        )


@pytest.mark.parametrize(
    "config",
    [
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16),
    ],
    ids=["prompt_tuning", "p_tuning"],
)
def test_peft_prompt_learning_streams_exactly(config):
    """Prompt tuning and p-tuning prepend trained embeddings (and -100 labels) to the input: the decoder streams the
    longer sequence, and the virtual tokens' gradients are those of plain autograd."""
    torch.manual_seed(0)
    reference = peft.get_peft_model(tiny_model("llama"), copy.deepcopy(config)).double()
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    assert is_streaming(model)
    ids, mask, labels = batch()

    def loss(m):
        if m is model:
            return m(input_ids=ids, attention_mask=mask, labels=labels).loss
        logits = m(input_ids=ids, attention_mask=mask).logits  # (batch, virtual + T, vocab)
        padded = F.pad(labels, (logits.shape[1] - labels.shape[1], 0), value=-100)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), padded[:, 1:].flatten())

    _exact_step(reference, model, loss)


# -- logits_to_keep ----------------------------------------------------------------------------------------------


def _plain_causal_lm_loss(model, ids, mask, labels, logits_to_keep):
    """transformers' ForCausalLMLoss of the model's own kept logits, in the model's dtype (it upcasts to float32
    only): labels shifted left by one within the kept positions, the last one padded with -100."""
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep).logits
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


@pytest.mark.parametrize(
    "logits_to_keep", [9, 0, torch.tensor([2, 5, 6, 7, 11, 20, 21])], ids=["last_9", "all", "positions"]
)
def test_logits_to_keep_with_labels_scores_the_kept_positions(logits_to_keep):
    """model(..., labels=labels, logits_to_keep=k) scores the logits the model's own forward keeps (the last k, or
    the given positions) against labels of that length, as transformers does."""
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, full_labels = batch()
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    labels = full_labels[:, keep]
    plain = reference(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=logits_to_keep).loss
    ours = model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=logits_to_keep).loss
    torch.testing.assert_close(ours.float(), plain, rtol=1e-6, atol=0)  # transformers' own (float32) loss
    _exact_step(reference, model, lambda m: _plain_causal_lm_loss(m, ids, mask, labels, logits_to_keep))


def test_logits_to_keep_with_shift_labels():
    reference = tiny_model("llama")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch()
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:][:, -6:]

    def loss(m):
        if m is model:
            return m(input_ids=ids, attention_mask=mask, shift_labels=shift_labels, logits_to_keep=6).loss
        logits = m(input_ids=ids, attention_mask=mask, logits_to_keep=6).logits
        return F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)

    _exact_step(reference, model, loss)


def test_logits_to_keep_that_cannot_be_served_is_refused():
    model = enable_streambp(tiny_model("llama"), stream_chunk_size=4)
    ids, mask, labels = batch()
    # transformers fails here too (a size mismatch in its cross-entropy): the kept logits are fewer than the labels
    with pytest.raises(ValueError, match=r"labels of shape \(2, 23\) .*logits_to_keep=5.*\(2, 5\)"):
        model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=5)
    # TRL's fused head would silently score every position: refuse rather than ignore
    with pytest.raises(ValueError, match="logits_to_keep=5 has no meaning with fused_lm_head=True"):
        model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=5, fused_lm_head=True)
    with pytest.raises(ValueError, match="int or a 1D tensor"):
        model(input_ids=ids, attention_mask=mask, labels=labels[:, :3], logits_to_keep=torch.ones(2, 3, dtype=int))
    # eval mode is the model's own forward: logits of the kept positions
    model.eval()
    assert model(input_ids=ids, attention_mask=mask, logits_to_keep=5).logits.shape == (2, 5, VOCAB)


# -- generation --------------------------------------------------------------------------------------------------


def test_generation_in_training_mode_is_the_models_own(monkeypatch):
    """generate() on a streaming model in training mode (as GRPO/RLOO sample) runs the layers as without the engine:
    with their key/value cache, no "Caching is incompatible with gradient checkpointing" warning, same tokens."""
    warnings = []
    monkeypatch.setattr(transformers.modeling_layers.logger, "warning_once", lambda *a, **k: warnings.append(a))
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids = batch()[0][:1, :6]
    caches = [DynamicCache(config=m.config) for m in (reference, model)]
    ref_tokens, tokens = (
        m.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, past_key_values=cache)
        for m, cache in zip((reference, model), caches, strict=True)
    )
    assert warnings == []
    assert torch.equal(tokens, ref_tokens) and model.training
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == ids.shape[1] + 4 - 1
    assert is_streaming(model)


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("hyperclovax", "logits_scaling", 0.37),
        ("granite", "logits_scaling", 4.0),
        ("falcon_h1", "lm_head_multiplier", 0.37),
        ("cohere", "logit_scale", 0.37),
        # the other factors the sweep's tiny configs leave at 1 (or their default): the first layer's input is rebuilt
        # from the token ids through the embedding's factor, the layers apply theirs in their own code
        ("falcon_h1", "embedding_multiplier", 0.37),
        ("falcon_h1", "key_multiplier", 0.37),
        ("falcon_h1", "attention_out_multiplier", 0.37),
        ("falcon_h1", "ssm_in_multiplier", 0.37),
        ("falcon_h1", "ssm_out_multiplier", 0.37),
        ("granite", "embedding_multiplier", 0.37),
        ("granite", "residual_multiplier", 0.37),
        ("granite", "attention_multiplier", 0.37),
        ("hyperclovax", "embedding_multiplier", 0.37),
        ("hrm_text", "embedding_scale", 0.37),
        ("minicpm3", "scale_depth", 0.37),
    ],
)
def test_scaled_heads_embeddings_and_residuals_stream_exactly(family, field, value):
    """A model's factors away from 1, which the sweep's tiny configs leave at 1. A head whose logits the model scales
    is read as TRL's fused head reads it: ``logits_scaling`` multiplies HyperCLOVA X's logits and divides Granite's;
    ``lm_head_multiplier`` multiplies Falcon-H1's. Before, HyperCLOVA X's was read as a divisor and Falcon-H1's not at
    all, and the probe refused both as non-linear heads."""
    from model_support import Float64Internals, streamed_error
    from zoo import batch as zoo_batch
    from zoo import tiny_causal_lm

    reference = tiny_causal_lm(family, **{field: value})
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert streamed_error(reference, streamed, *zoo_batch(padding="right"), Float64Internals)[0] < 1e-10
