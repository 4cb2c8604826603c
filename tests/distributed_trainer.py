"""One training step of StreamSFTTrainer or StreamDPOTrainer across processes, for tests/test_distributed_trainer.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_trainer.py \
        --objective sft|dpo --wrap ddp|fsdp2|zero1|zero2|zero3|zero3_offload --chunk 8 [--compile] --out F

The global batch is the whole (4-row) dataset, split across the ranks by accelerate's data loader, so the step
equals one process's step on the whole batch (tests/test_distributed_trainer.py computes that one). Wrappers:

* ``ddp``: what ``accelerate launch --cpu`` gives, accelerate's ``DistributedDataParallel`` (``use_cpu=True``).
* ``fsdp2``: accelerate's FSDP2 (``fsdp_version: 2``), on gloo (``gloo_state``). ``--fsdp layers`` (the default):
  ``fully_shard`` on every decoder layer and on the root, applied here before the trainer is built, and kept by
  accelerate; ``--fsdp accelerate``: accelerate's own preparation (transformer-layer auto wrap, and the embedding,
  final norm and LM head as one unit).
* ``zero1`` / ``zero2`` / ``zero3`` / ``zero3_offload``: DeepSpeed through the Trainer (``TrainingArguments.
  deepspeed``, accelerate's DeepSpeed plugin) on gloo, the config from ``deepspeed_config``; ``zero3_offload``
  offloads parameters and optimizer states to the CPU, with ``zero_force_ds_cpu_optimizer`` false (by default
  DeepSpeed applies its own CPU optimizer there, and the update is Adam's, not SGD's).
  ZeRO-3 partitions every parameter (``stage3_param_persistence_threshold: 0``); the stream engine makes the
  decoder layers ZeRO-3 leaf modules itself.

``--chunk`` sets both ``stream_chunk_size`` and ``logits_chunk_size``: the logit kernel's tile count changes with it.
``--compile`` sets ``torch_compile=True`` (each layer's per-chunk body compiled).

Rank 0 writes the applied update of every parameter (weights after the step minus before, float64, divided by the
learning rate), the logged metrics and the collective calls of the training step to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ROWS = 4  # the whole dataset is one global batch
LR = 1e4  # SGD: the update is -LR * grad, large enough that float32 rounding of the weights is ~1e-7 of it


def counters_of_dynamo() -> int:
    """How many graphs torch.compile compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def deepspeed_config(wrap: str) -> dict:
    """The DeepSpeed config of a ``zero*`` wrap, with the Trainer's ``"auto"`` values, as configs/accelerate has."""
    stage = int(wrap[4])
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    if wrap == "zero3_offload":
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # keep the Trainer's SGD with the optimizer offloaded
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def dataset(objective: str):
    """The whole dataset of ``objective``: ``ROWS`` chat rows (SFT) or preference pairs (DPO)."""
    from helpers import tiny_dataset

    return tiny_dataset("chat" if objective == "sft" else "preference", ROWS)


def training_args(
    objective: str, wrap: str, output_dir: str, world: int, chunk: int, accum: int, fsdp_layers: bool = True, **extra
):
    """The same step in one process (``world=1``) and in ``world`` processes: a global batch of ``ROWS``, the SGD step
    of ``helpers.args`` with learning rate ``LR``."""
    from helpers import args

    from streambp_trl import StreamDPOConfig, StreamSFTConfig

    config_cls = StreamSFTConfig if objective == "sft" else StreamDPOConfig
    kw = dict(
        per_device_train_batch_size=ROWS // world // accum,
        gradient_accumulation_steps=accum,
        learning_rate=LR,
        stream_chunk_size=chunk,
        logits_chunk_size=chunk,
        max_length=128,
        use_cpu=wrap in ("none", "ddp"),
    )
    if wrap == "fsdp2":  # fsdp_layers: the model comes sharded, accelerate keeps it
        kw["fsdp"] = "full_shard" if fsdp_layers else "full_shard auto_wrap"
        kw["fsdp_config"] = {"version": 2} | (
            {} if fsdp_layers else {"transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}
        )
    if wrap.startswith("zero"):
        kw["deepspeed"] = deepspeed_config(wrap)
    if wrap in ("fsdp2",) or wrap.startswith("zero"):
        kw["accelerator_config"] = {"use_configured_state": True}  # the state of gloo_state()
    return args(config_cls, output_dir, **{**kw, **extra})


def gloo_state(wrap: str) -> None:
    """Accelerate's DeepSpeed or FSDP state on gloo, as ``accelerate launch`` builds it on GPUs.

    On a machine without GPUs accelerate gives neither: the Trainer builds a DeepSpeed state without a backend (one
    process to accelerate, while DeepSpeed runs on all) and turns FSDP into DDP. Build the state first on gloo, with
    the distributed type the GPU launch would have; the Trainer then uses it (``use_configured_state``) and runs its
    own DeepSpeed or FSDP2 preparation (``deepspeed.initialize``, or ``fully_shard`` per decoder layer and root).
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if wrap == "fsdp2":
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        # accelerate picks FSDP (and keeps its plugin) only for a multi-device state: say so, on gloo and the CPU
        PartialState(backend="gloo").distributed_type = DistributedType.MULTI_GPU
    else:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch` with a DeepSpeed config sets
        import deepspeed.ops

        # gloo's own collectives: DeepSpeed's shared-memory all-reduce for CPUs is a C++ op compiled at its first use
        # (into ~/.cache/torch_extensions, both ranks waiting on one lock file), a build these tests do not check and
        # that can fail or hang on a fresh machine
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        PartialState(backend="gloo")


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (collectives: call on every rank)."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().double().clone() for n, p in params.items()}
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().clone() for n, p in params.items()
    }


class CountCollectives:
    """Counts, during training steps only, the collectives torch.distributed and deepspeed.comm issue, and the
    parameters DeepSpeed's ZeRO optimizers reduce (its per-parameter gradient hook)."""

    TORCH = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "broadcast",
    )

    def __init__(self):
        self.counter: Counter = Counter()
        self.active = False
        self._patch(dist, self.TORCH, "torch.")
        try:
            import deepspeed.comm as ds_comm
            from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        except ImportError:
            return
        self._patch(ds_comm, ("all_reduce", "all_gather_into_tensor", "reduce_scatter_fn", "allgather_fn"), "ds.")
        for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
            original = cls.reduce_ready_partitions_and_remove_grads

            def reduce_ready(opt, param, *args, _original=original, **kwargs):
                if self.active:
                    self.counter[("reduced", id(param))] += 1
                return _original(opt, param, *args, **kwargs)

            cls.reduce_ready_partitions_and_remove_grads = reduce_ready

    def _patch(self, module, names, prefix):
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapped(*args, _original=original, _name=prefix + name, **kwargs):
                if self.active:
                    self.counter[_name] += 1
                return _original(*args, **kwargs)

            setattr(module, name, wrapped)

    def summary(self, model) -> dict:
        names = {id(p): n for n, p in model.named_parameters()}
        out = {k: v for k, v in self.counter.items() if isinstance(k, str)}
        out.update({f"reduced {names.get(k[1], k[1])}": v for k, v in self.counter.items() if isinstance(k, tuple)})
        return out


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hung collective shows where, instead of hanging the suite
    parser = argparse.ArgumentParser()
    parser.add_argument("--objective", choices=("sft", "dpo"), required=True)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"), required=True)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--fsdp", choices=("layers", "accelerate"), default="layers")
    parser.add_argument("--compile", action="store_true", help="torch_compile=True (the layers' per-chunk bodies)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    counter = CountCollectives()

    from helpers import load_model, load_tokenizer
    from transformers import TrainerCallback

    from streambp_trl import StreamDPOTrainer, StreamSFTTrainer

    class Window(TrainerCallback):
        def on_step_begin(self, *a, **k):
            counter.active = True

        def on_step_end(self, *a, **k):
            counter.active = False

    before = {n: p.detach().double().clone() for n, p in load_model().named_parameters()}
    if args.wrap != "ddp":
        gloo_state(args.wrap)
    output_dir = str(Path(args.out).parent / "run")
    fsdp_layers = args.fsdp == "layers"
    compiled = {"torch_compile": True} if args.compile else {}
    steps = (args.chunk, args.accum, fsdp_layers)
    config = training_args(args.objective, args.wrap, output_dir, world, *steps, **compiled)
    model = load_model()  # after the config: under ZeRO-3 transformers builds it partitioned (zero.Init)
    partitioned_at_load = any(hasattr(p, "ds_id") for p in model.parameters())
    if args.wrap == "fsdp2" and args.fsdp == "layers":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:  # accelerate's own preparation sees an FSDP model and keeps it
            fully_shard(layer)
        fully_shard(model)
    extra = {"ref_model": load_model()} if args.objective == "dpo" else {}
    trainer_cls = StreamSFTTrainer if args.objective == "sft" else StreamDPOTrainer
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=dataset(args.objective),
        processing_class=load_tokenizer(),
        callbacks=[Window()],
        **extra,
    )
    if args.wrap == "fsdp2" and fsdp_layers:  # sharded already: no wrap policy (it looks for Qwen3DecoderLayer)
        trainer.accelerator.state.fsdp_plugin.auto_wrap_policy = None
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    after = full_parameters(unwrapped)
    update = {n: (after[n] - before[n]) / LR for n in before}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(trainer.model_wrapped).__name__,
        "wrapper_bases": [cls.__name__ for cls in type(trainer.model_wrapped).__mro__],
        "num_processes": trainer.accelerator.num_processes,
        "partitioned_at_load": partitioned_at_load,
        "compiled_graphs": counters_of_dynamo(),
        "z3_leaf_layers": sum(bool(getattr(layer, "_z3_leaf", False)) for layer in unwrapped.model.layers),
        "collectives": counter.summary(unwrapped),
    }
    if int(os.environ["RANK"]) == 0:
        torch.save({"update": update, "logs": logs, **summary}, args.out)
        print(json.dumps(summary, default=str))
    dist.barrier()
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


if __name__ == "__main__":
    main()
