"""What the stream trainers and configs set for the user: DDP without the unused-parameter search (and why that is
right for streamed layers), activation checkpointing without TRL's deprecated default, and ``stream_chunk_size`` as
an int or ``'auto'``.

Run as a script (``torchrun --nproc_per_node 2 tests/test_trainer_options.py --out F``) it is the two-process worker
of :func:`test_ddp_without_the_search_reduces_a_parameter_no_chunk_reached`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import ROOT, args, assert_each_close, load_model, load_tokenizer, tiny_dataset, torchrun  # noqa: E402
from models import batch, tiny_model  # noqa: E402
from trl import SFTConfig  # noqa: E402

from streambp_trl import (  # noqa: E402
    StreamDPOConfig,
    StreamGRPOConfig,
    StreamKTOConfig,
    StreamRLOOConfig,
    StreamSFTConfig,
    StreamSFTTrainer,
    enable_streambp,
)
from streambp_trl.trainers.stream_config import StreamArguments  # noqa: E402

CONFIGS = (StreamSFTConfig, StreamDPOConfig, StreamKTOConfig, StreamGRPOConfig, StreamRLOOConfig)
ROWS = 4  # of the batch; each of the two processes takes half


def _model_with_a_parameter_no_chunk_reaches():
    """The tiny Qwen3 with one more trainable parameter on layer 0 that its forward never reads (as an expert no
    token is routed to): the streamed Function takes it as an input and returns ``None`` for it."""
    model = tiny_model("qwen3", dtype=torch.float32)
    model.model.layers[0].unreached = torch.nn.Parameter(torch.ones(3))
    return model


def _loss(model, rows: slice, world: int) -> torch.Tensor:
    """The loss of ``rows`` of the batch, summed over tokens and divided by the whole batch's tokens, times the world
    size (DDP averages): the gradients of all processes average to those of one process on the whole batch."""
    ids, mask, labels = batch(batch_size=ROWS, padding="right")
    tokens = int((labels[:, 1:] != -100).sum())
    out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], num_items_in_batch=tokens)
    return out.loss * world


def _worker() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = enable_streambp(_model_with_a_parameter_no_chunk_reaches(), stream_chunk_size=4)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for _ in range(2):  # DDP finds a parameter left unreduced only when the next forward starts
        model.zero_grad(set_to_none=True)
        _loss(ddp, rows, world).backward()
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    dist.barrier()
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


def _trainer(tmp_path, **overrides) -> StreamSFTTrainer:
    return StreamSFTTrainer(
        model=load_model(),
        args=args(StreamSFTConfig, tmp_path, max_length=64, **overrides),
        train_dataset=tiny_dataset("chat", 4),
        processing_class=load_tokenizer(),
    )


@pytest.mark.parametrize("config_cls", [StreamSFTConfig, SFTConfig])
def test_activation_offloading_is_the_engines_checkpoint_offload(tmp_path, config_cls):
    """TRL's activation_offloading=True becomes the engine's offload_checkpoints=True in the trainer's copy of the
    config, and TRL's own offloading is off: never a second offload on top of the engine's."""
    config = args(config_cls, tmp_path, max_length=64, activation_offloading=True)
    trainer = StreamSFTTrainer(
        model=load_model(), args=config, train_dataset=tiny_dataset("chat", 4), processing_class=load_tokenizer()
    )
    assert trainer.stream_options.offload_checkpoints
    assert not trainer.args.activation_offloading and config.activation_offloading  # the caller's config unchanged


@pytest.mark.parametrize(
    "config_cls", [c for c in CONFIGS if "activation_offloading" in c.__dataclass_fields__], ids=lambda c: c.__name__
)
def test_offload_checkpoints_false_beside_activation_offloading_is_refused(tmp_path, config_cls):
    """offload_checkpoints=False set beside TRL's activation_offloading=True (the engine's offload_checkpoints=True):
    activation_offloading won, said at info level only. Refused now when the config is built, in one line naming both
    settings and how to keep either; offload_checkpoints=True beside it, or unset, offloads."""
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_offloading=True)
    with pytest.raises(ValueError) as error:
        config_cls(**common, offload_checkpoints=False)
    message = str(error.value)
    assert message.startswith("offload_checkpoints=False contradicts activation_offloading=True")
    assert "\n" not in message
    assert "set activation_offloading=False" in message and "leave offload_checkpoints unset" in message
    for setting in (True, None):
        assert config_cls(**common, offload_checkpoints=setting).to_options().offload_checkpoints
    common["activation_offloading"] = False
    assert config_cls(**common, offload_checkpoints=False).to_options().offload_checkpoints is False


@pytest.mark.parametrize("setting, expected", [(None, False), (True, True), (False, False)])
def test_ddp_does_not_search_for_unused_parameters_unless_asked(tmp_path, setting, expected):
    """transformers turns the search on when Hugging Face checkpointing is off, as the stream trainers turn it; a
    value the user sets is kept."""
    overrides = {} if setting is None else {"ddp_find_unused_parameters": setting}
    trainer = _trainer(tmp_path, **overrides)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is expected
    assert trainer.args.ddp_find_unused_parameters is setting


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_without_the_search_reduces_a_parameter_no_chunk_reached(tmp_path):
    """Why the search is not needed: a streamed layer's Function hands DDP a gradient for every parameter of the layer
    in every backward (``None`` for one no chunk reached, which DDP reduces as zeros), so two DDP steps run without
    ``find_unused_parameters`` and give the gradients of plain autograd on the whole batch in one process (the
    parameter no chunk reached: zero, where plain autograd leaves none). Plain autograd under DDP without the search
    fails on the second step here."""
    torchrun("test_trainer_options.py", "--out", str(tmp_path / "grads.pt"), log=tmp_path / "worker.log")
    grads = torch.load(tmp_path / "grads.pt")
    plain = _model_with_a_parameter_no_chunk_reaches()
    _loss(plain, slice(0, ROWS), 1).backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    assert grads.keys() == expected.keys()
    assert expected["model.layers.0.unreached"] is None and torch.equal(
        grads["model.layers.0.unreached"], torch.zeros(3)
    )
    reached = [name for name, g in expected.items() if g is not None]
    assert_each_close({n: expected[n] for n in reached}, {n: grads[n] for n in reached}, 1e-5, "gradient")


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_configs_checkpoint_by_default_without_the_deprecated_name(tmp_path, config_cls):
    """TRL's configs default the deprecated `gradient_checkpointing=True`, which transformers warns about on every
    config (so on every run); ours default to the same under `activation_checkpointing`. Setting the deprecated name
    still works (with transformers' warning)."""
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = config_cls(**common)
    assert not [w for w in caught if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]
    assert config.activation_checkpointing and config.gradient_checkpointing
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        off = config_cls(**common, gradient_checkpointing=False)
    assert not off.activation_checkpointing and not off.gradient_checkpointing
    assert not config_cls(**common, activation_checkpointing=False).gradient_checkpointing


def test_stream_chunk_size_is_an_int_or_auto():
    hints = typing.get_type_hints(StreamArguments)
    assert hints["stream_chunk_size"] == int | str and hints["logits_chunk_size"] == int | str | None
    text = {f.name: f.metadata["help"] for f in dataclasses.fields(StreamArguments)}["stream_chunk_size"]
    assert "an int, or 'auto' (default): per batch shape, the plan of least predicted time" in text
    assert "fits memory_budget (or the GPU's free memory, or on the CPU the host memory available)" in text


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("64", 64)])
def test_the_command_line_reads_stream_chunk_size_as_an_int_or_auto(value, expected):
    from streambp_trl.cli import parse_args

    config = str(ROOT / "configs" / "sft_tiny.yaml")
    _, training_args, _, _ = parse_args("sft", ["--config", config, "--stream_chunk_size", value])
    assert training_args.stream_chunk_size == expected


if __name__ == "__main__":
    _worker()
