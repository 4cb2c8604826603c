"""Packed rows through recurrent mixers: the sequence descriptors of TRL's padding-free collator (``packing=True``'s
default "bfd" strategy, or ``padding_free=True``): one flattened row, position ids that restart, ``cu_seq_lens_q/k``
and ``seq_idx``.

A Gated DeltaNet, a Mamba2 or LFM2's short convolution hands the descriptors to its kernels (fla's recurrence,
mamba-ssm's scan, causal-conv1d), which start each document from a zero state; transformers' torch fallbacks refuse
them (:func:`streambp_trl.layers.traits.keeps_documents_apart` reads which calls pass them). The stream engine
cuts such a layer's chunks at every document start and starts each document from a zero state itself, so each chunk
holds one document and runs the model's own code without descriptors (on the CPU as on CUDA). The reference is each
document run alone by plain autograd: the loss over the row's predicted tokens and its gradient, float64 (float32
internals in float64, bound 1e-10), with a one-token document and chunk sizes that cut documents anywhere. A mixer
that passes no descriptors (LFM3's convolution) runs across the documents in the plain model, and streams as it
does; one that passes them to some kernels only (Mamba v1: its convolution, not its scan) is refused.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT, load_tokenizer
from model_support import Float64Internals, each_document_alone, packed_row, relative_errors
from zoo import tiny_causal_lm

from streambp_trl import StreamSFTConfig, StreamSFTTrainer, enable_streambp
from streambp_trl.attention import StreamMask, stream_configs
from streambp_trl.engine import packed_rows_refusal
from streambp_trl.layers import hook
from streambp_trl.layers.adapters import recurrent
from streambp_trl.layers.adapters.varlen import VarlenAttention
from streambp_trl.sizing.choices import PlanChoices

pytestmark = pytest.mark.slow  # ~3 minutes


def _errors(family: str, chunk: int, mutate=None) -> tuple[float, float]:
    reference = tiny_causal_lm(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    if mutate is not None:
        mutate()
    return _against_each_document_alone(reference, streamed)


def _against_each_document_alone(reference, streamed) -> tuple[float, float]:
    """Relative loss and gradient errors of ``streamed`` on a packed row against each document run alone by plain
    autograd (float32 internals in float64)."""
    docs, inputs = packed_row()
    with Float64Internals():
        ref_loss = each_document_alone(reference, docs)
        ref_loss.backward()
        loss = streamed(**inputs).loss
        loss.backward()
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), relative_errors(reference, streamed)[0]


@pytest.mark.parametrize("family", ["qwen3_5_text", "kimi_linear", "nemotron_h", "lfm2"])
@pytest.mark.parametrize("chunk", [4, 5, 7])
def test_packed_documents_stream_as_each_alone(family, chunk):
    loss_err, grad_err = _errors(family, chunk)
    assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err)


def test_fails_when_the_documents_run_together(monkeypatch):
    """The comparison can fail: chunks not cut at the documents (each mixer carrying its state from one document
    into the next) give another loss and gradient."""
    loss_err, grad_err = _errors(
        "qwen3_5_text", 5, mutate=lambda: monkeypatch.setattr(recurrent, "document_starts", lambda cu, seq_len: ())
    )
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)


def _against_the_plain_row(family: str) -> tuple[float, float, float]:
    """The streamed ``family`` model on the packed row against the plain model on the same row (descriptors and all),
    float64: relative loss and gradient errors, and how far the plain row's loss is from each document run alone."""
    reference = tiny_causal_lm(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    docs, inputs = packed_row()
    labels = inputs.pop("labels")
    with Float64Internals():
        logits = reference(**inputs).logits
        ref_loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
        ref_loss.backward()
        loss = streamed(**inputs, labels=labels).loss
        loss.backward()
        alone = each_document_alone(copy.deepcopy(reference), docs).item()
    loss_err = abs(loss.item() - ref_loss.item()) / ref_loss.item()
    return loss_err, relative_errors(reference, streamed)[0], abs(alone - ref_loss.item())


def _granite_hybrid_errors(chunk: int, implementation: str) -> tuple[float, float]:
    """Granite 4 hybrid (Mamba2 and attention layers, its attention mask built without the position ids) on a packed
    row against each document alone, with the model's own attention ``implementation`` named in its config. The CPU
    has no flash kernel, but a streamed call never runs the model's own attention (unprobed, and the reference is a
    separate SDPA model), so the implementation is only named."""
    reference = tiny_causal_lm("granitemoehybrid")
    streamed = copy.deepcopy(reference)
    for config in stream_configs(streamed):
        config._attn_implementation_internal = implementation
    enable_streambp(streamed, stream_chunk_size=chunk, verify=False)
    return _against_each_document_alone(reference, streamed)


@pytest.mark.parametrize("chunk", [4, 5, 7])
def test_flash_attention_keeps_packed_documents_apart(chunk):
    """With flash attention the model's own attention runs its variable-length kernel over the documents
    (``cu_seq_lens``), whatever its mask: the stream attention keeps them apart as well, and with the Mamba2 layers
    (whose kernels keep them apart) the row streams as each document alone."""
    loss_err, grad_err = _granite_hybrid_errors(chunk, "flash_attention_2")
    assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err)


def test_flash_keeps_documents_apart_by_restarting_position_ids():
    """Flash attention's other packed form, one row with position ids that restart and no ``cu_seq_lens``
    (transformers' ``prepare_fa_kwargs_from_position_ids``): the documents start where the position ids restart."""
    model = tiny_causal_lm("llama")
    mask = StreamMask(batch_size=1)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert VarlenAttention.documents({"attention_mask": mask, "position_ids": positions}, 8) == (3, 5)
    assert VarlenAttention.documents({"attention_mask": mask, "position_ids": torch.arange(8)[None]}, 8) == ()
    # its own attention is SDPA
    sdpa = hook.LayerFacts.of(model.model.layers[0], PlanChoices(), type(model.model), None)
    assert not any(isinstance(a, VarlenAttention) for a in sdpa.adapters)


def test_sdpa_attention_follows_a_mask_that_runs_documents_together():
    """With SDPA the model's attention follows its mask, which runs Granite 4 hybrid's documents together, and so
    does the stream attention: the row is then not each document alone (the comparison above can fail)."""
    loss_err, grad_err = _granite_hybrid_errors(5, "sdpa")
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)


def test_mixers_that_read_no_descriptors_run_across_documents():
    """transformers 5.23's LFM3 short convolution hands no descriptor to a kernel: the plain model runs it across the
    documents (its attention keeps them apart by the packed mask), and so does the streamed one. transformers 5.24's
    hands them to ``causal_conv1d``, which keeps the documents apart (its reference path, all a CPU without the
    package has, refuses a packed row): there the streamed row is each document alone."""
    try:
        loss_err, grad_err, from_alone = _against_the_plain_row("lfm3")
    except ValueError as error:
        if "can't keep packed sequences apart" not in str(error):
            raise
        reference = tiny_causal_lm("lfm3")
        streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
        loss_err, grad_err = _against_each_document_alone(reference, streamed)
        assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err)
        return
    assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err)
    assert from_alone > 1e-6  # the documents do run together


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_a_model_whose_forward_keeps_the_descriptors_from_its_decoder(family):
    """Mamba2ForCausalLM and MambaForCausalLM hand their backbone only the arguments their forward names (any other
    keyword goes to their loss): their layers never see the descriptors and their scans run across the documents.
    The streamed forward hands the decoder the same arguments (``EngineState.decoder_keywords``); it handed on every
    keyword before, and the Mamba2 layers then kept the documents apart (a relative loss error of 8e-3)."""
    loss_err, grad_err, _ = _against_the_plain_row(family)
    assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err)


def test_packed_rows_kept_apart_in_part_are_refused():
    """Zamba's Mamba (v1) hands the descriptors to its convolution but not to its selective scan."""
    model = enable_streambp(tiny_causal_lm("zamba"), stream_chunk_size=5)
    with pytest.raises(ValueError, match="keep the documents apart in part"):
        model(**packed_row()[1])


def test_sft_refuses_packing_at_construction_where_the_layers_cannot_take_it(tmp_path):
    """With ``packing=True`` (padding-free rows), a model whose layers keep documents apart in part is refused when
    the trainer is built, not at its first step."""
    from datasets import Dataset

    tokenizer = load_tokenizer()
    model = tiny_causal_lm("zamba", dtype=torch.float32, vocab_size=len(tokenizer))
    args = StreamSFTConfig(output_dir=str(tmp_path), packing=True, max_length=32, bf16=False, report_to="none")
    dataset = Dataset.from_dict({"text": ["a b c"] * 4})
    with pytest.raises(ValueError, match="StreamSFTTrainer: StreamBP cannot stream packed rows .* apart in part"):
        StreamSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def test_packing_is_refused_only_where_the_layers_would_see_the_descriptors():
    """Mamba's layers keep documents apart in part, but its forward never hands them the descriptors (it names its
    backbone's arguments): packed rows reach it as plain rows, and a trainer must not refuse them."""
    assert packed_rows_refusal(enable_streambp(tiny_causal_lm("zamba"), stream_chunk_size=5)) is not None
    assert packed_rows_refusal(enable_streambp(tiny_causal_lm("mamba"), stream_chunk_size=5)) is None
    assert packed_rows_refusal(enable_streambp(tiny_causal_lm("qwen3_5_text"), stream_chunk_size=5)) is None


def test_seq_idx_without_cu_seq_lens_is_refused():
    model = enable_streambp(tiny_causal_lm("qwen3_5_text"), stream_chunk_size=5)
    inputs = packed_row()[1]
    del inputs["cu_seq_lens_q"], inputs["cu_seq_lens_k"]
    with pytest.raises(ValueError, match="got `seq_idx` without `cu_seq_lens_q`"):
        model(**inputs)


def test_packed_rows_of_several_rows_are_refused():
    model = enable_streambp(tiny_causal_lm("qwen3_5_text"), stream_chunk_size=5)
    inputs = packed_row()[1]
    for name in ("input_ids", "position_ids", "labels", "seq_idx"):
        inputs[name] = inputs[name].expand(2, -1)
    with pytest.raises(ValueError, match="describe one flattened row, got a batch of 2 rows"):
        model(**inputs)


def test_sft_packing_trains_a_gated_deltanet_hybrid(tmp_path, monkeypatch):
    """``packing=True`` (TRL's "bfd" strategy: padding-free rows with sequence descriptors) trains a tiny Qwen3.5
    with StreamSFTTrainer on the CPU, where TRL's own SFTTrainer stops: transformers' torch fallback of the Gated
    DeltaNet refuses the descriptors."""
    from datasets import Dataset

    tokenizer = load_tokenizer()
    texts = [" ".join(["word"] * n) for n in (5, 9, 3, 12, 7, 4, 10, 6)]
    dataset = Dataset.from_dict({"text": texts})
    options = dict(
        output_dir=str(tmp_path),
        packing=True,
        max_length=32,
        per_device_train_batch_size=2,
        max_steps=2,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
    )
    model = tiny_causal_lm("qwen3_5_text", dtype=torch.float32, vocab_size=len(tokenizer))
    trainer = StreamSFTTrainer(
        model=model,
        args=StreamSFTConfig(**options, stream_chunk_size=5),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    starts = []

    def recorded(cu_seq_lens, seq_len):
        starts.append(hook_document_starts(cu_seq_lens, seq_len))
        return starts[-1]

    hook_document_starts = recurrent.document_starts
    monkeypatch.setattr(recurrent, "document_starts", recorded)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.padding_free and starts and all(starts)  # packed rows of several documents reached the layers


def test_adapters_declare_their_order():
    """A trait that must follow another says so (``after``), whatever order the adapters are listed in: the mixers'
    document cut takes the sequence descriptors only after flash's variable-length attention has read them; a cycle
    is refused by name."""
    from streambp_trl.layers.adapters import ADAPTERS, LayerAdapter, in_order

    assert in_order((recurrent.RecurrentMixers, VarlenAttention)) == (VarlenAttention, recurrent.RecurrentMixers)
    assert ADAPTERS.index(VarlenAttention) < ADAPTERS.index(recurrent.RecurrentMixers)

    class First(LayerAdapter):
        pass

    class Second(LayerAdapter):
        after = (First,)

    First.after = (Second,)
    with pytest.raises(ValueError, match="First.*Second.*cycle"):
        in_order((First, Second))
