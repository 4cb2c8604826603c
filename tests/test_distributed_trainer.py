"""StreamSFTTrainer and StreamDPOTrainer on two CPU processes (gloo) through accelerate: DDP, FSDP2 (``fully_shard``
per layer, and accelerate's own preparation) and DeepSpeed ZeRO-2/3 (ZeRO-3 also with parameters and optimizer states
offloaded) apply the update of one process on the whole batch, with one gradient reduction per parameter per
micro-step (and, for ZeRO-3 and FSDP2, the same parameter gathers) whatever the number of chunks.

Each case is one ``torchrun`` of tests/distributed_trainer.py (about 10 s); the one-process reference runs here.
"""

from __future__ import annotations

import functools

import distributed_trainer as worker
import pytest
import torch
from helpers import assert_each_close, load_model, load_tokenizer, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYERS = 2  # configs/tiny_model


@functools.cache
def _reference(objective: str) -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole batch, one step: the update per parameter (divided by the learning rate), the loss."""
    import tempfile

    from streambp_trl import StreamDPOTrainer, StreamSFTTrainer

    before = {n: p.detach().double().clone() for n, p in load_model().named_parameters()}
    extra = {"ref_model": load_model()} if objective == "dpo" else {}
    trainer_cls = StreamSFTTrainer if objective == "sft" else StreamDPOTrainer
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_cls(
            model=load_model(),
            args=worker.training_args(objective, "none", tmp, world=1, chunk=8, accum=1),
            train_dataset=worker.dataset(objective),
            processing_class=load_tokenizer(),
            **extra,
        )
        trainer.train()
    update = {n: (p.detach().double() - before[n]) / worker.LR for n, p in trainer.model.named_parameters()}
    return update, next(h["loss"] for h in trainer.state.log_history if "loss" in h)


_RUNS: dict[tuple, dict] = {}


def _run(tmp_path_factory, objective: str, wrap: str, chunk: int = 8, accum: int = 1, *flags: str) -> dict:
    key = (objective, wrap, chunk, accum, *flags)
    if key not in _RUNS:
        name = "_".join(map(str, key)).replace("-", "")
        out = tmp_path_factory.mktemp(name) / "result.pt"
        args = ("--objective", objective, "--wrap", wrap, "--chunk", str(chunk), "--accum", str(accum), *flags)
        torchrun("distributed_trainer.py", *args, "--out", str(out), log=out.with_suffix(".log"))
        _RUNS[key] = torch.load(out)
    return _RUNS[key]


def _assert_same_update(result: dict, objective: str) -> None:
    expected, _ = _reference(objective)
    assert result["num_processes"] == 2
    assert_each_close(expected, result["update"], 1e-5)


# objective, wrap, chunk, gradient accumulation steps, worker flags; accelerate's distributed type and model wrapper
CASES = [
    ("sft", "ddp", 8, 1, (), "MULTI_CPU", "DistributedDataParallel"),
    ("sft", "ddp", 3, 2, (), "MULTI_CPU", "DistributedDataParallel"),  # no_sync on the first micro-step
    ("sft", "zero2", 3, 2, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "zero2", 7, 2, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "zero3", 3, 1, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "zero3", 7, 1, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "zero3_offload", 5, 1, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "fsdp2", 3, 1, (), "FSDP", "FSDPModule"),  # fully_shard per layer and root, before the trainer
    ("sft", "fsdp2", 7, 1, (), "FSDP", "FSDPModule"),
    ("sft", "fsdp2", 8, 1, ("--fsdp", "accelerate"), "FSDP", "FSDPModule"),  # accelerate's own preparation
    ("dpo", "ddp", 8, 1, (), "MULTI_CPU", "DistributedDataParallel"),
    ("dpo", "zero2", 8, 1, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("dpo", "zero3", 6, 1, (), "DEEPSPEED", "DeepSpeedEngine"),
    ("dpo", "fsdp2", 8, 1, ("--fsdp", "accelerate"), "FSDP", "FSDPModule"),
    # torch_compile=True: each layer's per-chunk body compiled, against the eager one-process step
    ("sft", "ddp", 8, 1, ("--compile",), "MULTI_CPU", "DistributedDataParallel"),
    ("sft", "zero3", 7, 1, ("--compile",), "DEEPSPEED", "DeepSpeedEngine"),
    ("sft", "fsdp2", 7, 1, ("--compile",), "FSDP", "FSDPModule"),
]


@pytest.mark.parametrize(
    "objective, wrap, chunk, accum, flags, distributed_type, wrapper",
    CASES,
    ids=[f"{o}-{w}-chunk{c}-accum{a}{''.join(f)}" for o, w, c, a, f, *_ in CASES],
)
def test_two_processes_apply_the_one_process_update(
    tmp_path_factory, objective, wrap, chunk, accum, flags, distributed_type, wrapper
):
    result = _run(tmp_path_factory, objective, wrap, chunk, accum, *flags)
    assert result["distributed_type"] == f"DistributedType.{distributed_type}", result["distributed_type"]
    assert wrapper in result["wrapper_bases"], result["wrapper"]
    _assert_same_update(result, objective)
    (log,) = result["logs"]
    assert abs(log["loss"] - _reference(objective)[1]) < 1e-5, (log, _reference(objective)[1])
    if wrap.startswith("zero3"):  # the engine made the decoder layers ZeRO-3 leaf modules itself
        assert result["partitioned_at_load"] and result["z3_leaf_layers"] == LAYERS
    assert (result["compiled_graphs"] > 0) == ("--compile" in flags), result["compiled_graphs"]


def _parameters() -> set[str]:
    return {n for n, _ in load_model().named_parameters()}


def _reduced(collectives: dict) -> dict:
    return {k.removeprefix("reduced "): v for k, v in collectives.items() if k.startswith("reduced ")}


def test_zero2_reduces_every_parameter_once_per_micro_step_whatever_the_chunks(tmp_path_factory):
    runs = [_run(tmp_path_factory, "sft", "zero2", chunk, 2)["collectives"] for chunk in (3, 7)]
    for collectives in runs:
        assert _reduced(collectives) == dict.fromkeys(_parameters(), 2), collectives  # 2 micro-steps
    assert runs[0] == runs[1]


def test_zero3_gathers_and_reduces_the_same_whatever_the_chunks(tmp_path_factory):
    """Each decoder layer (a ZeRO-3 leaf module) is gathered once for its forward and once for its streamed backward,
    the LM head and final norm once around the logit kernel's forward and once for its backward, and every parameter
    is reduce-scattered once, for 3 and 7 tokens per layer chunk and logit tile alike (the two ranks' sequences have
    different lengths, so different chunk counts: a per-chunk gather would not even pair up)."""
    runs = [_run(tmp_path_factory, "sft", "zero3", chunk, 1)["collectives"] for chunk in (3, 7)]
    for collectives in runs:
        assert _reduced(collectives) == dict.fromkeys(_parameters(), 1), collectives
    assert runs[0] == runs[1]


def test_fsdp2_gathers_and_reduces_the_same_whatever_the_chunks(tmp_path_factory):
    """``fully_shard`` per decoder layer and root: forward gathers the root and each layer, the backward each layer
    again, and every unit is reduce-scattered once."""
    runs = [_run(tmp_path_factory, "sft", "fsdp2", chunk)["collectives"] for chunk in (3, 7)]
    for collectives in runs:
        assert collectives["torch.all_gather_single"] == 1 + 2 * LAYERS, collectives
        assert collectives["torch.reduce_scatter_single"] == LAYERS + 1, collectives
    assert runs[0] == runs[1]
