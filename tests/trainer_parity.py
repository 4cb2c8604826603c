"""Shared by the trainer tests: run TRL's trainer and ours on the same inputs and compare what they do."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from test_memory_shapes import _Shapes
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from streambp_trl.engine import is_streaming

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "configs" / "tiny_model"
CHUNK = 8  # far below the sequence lengths, so every layer really streams


def args(config_cls, output_dir, stream: bool, **overrides):
    """One SGD step, learning rate 1, no clipping or decay, float32 on the CPU: the update is -grad."""
    base = dict(
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    if stream:
        base.update(stream_chunk_size=CHUNK, logits_chunk_size=5)
    return config_cls(**{**base, **overrides})


class RecordUpdate(TrainerCallback):
    """The update SGD applies, -lr * grad, taken before it is added to the float32 weights.

    Stored float32 weights round p + dp to the spacing of p (about 1e-7 for a norm weight of 1), which is 1e-4 of
    a typical one-step update here, above the 1e-5 bar; the update itself is what the two trainers compute.
    """

    def __init__(self):
        self.update: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.update = {
            n.replace("base_model.model.", ""): -args.learning_rate * p.grad.detach().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }


class ShapesEveryStep(TrainerCallback):
    """Records every tensor shape produced during the training steps, and whether the model still streams after
    each step."""

    def __init__(self):
        self.recorder, self.streaming = _Shapes(), []

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.__enter__()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.recorder.__exit__(None, None, None)
        self.streaming.append(is_streaming(model))


def model():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def train(trainer_cls, config_cls, output_dir, dataset, stream, ref="created", peft_config=None, **overrides):
    """Train ``trainer_cls`` on ``dataset``; ``ref``: ``"created"`` by the trainer, or ``"given"`` as ``ref_model``."""
    record = RecordUpdate()
    trainer = trainer_cls(
        model=model(),
        ref_model=model() if ref == "given" else None,
        args=args(config_cls, Path(output_dir) / trainer_cls.__name__, stream, **overrides),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(MODEL),
        peft_config=copy.deepcopy(peft_config),
        callbacks=[record],
    )
    trainer.train()
    return trainer, record.update


def assert_same(trl_pair, stream_pair, output_dir, dataset, ref="created", peft_config=None, **overrides):
    """Our trainer's update and logged metrics equal TRL's (relative 1e-5), and its models stream."""
    ref_overrides = {k: v for k, v in overrides.items() if not k.startswith("stream_")}  # ours only
    ref_trainer, ref_update = train(*trl_pair, output_dir, dataset, False, ref, peft_config, **ref_overrides)
    ours, update = train(*stream_pair, output_dir, dataset, True, ref, peft_config, **overrides)
    compare(ref_trainer, ref_update, ours, update)
    return ref_trainer, ours


def compare(ref_trainer, ref_update, ours, update) -> None:
    """The same parameter update (relative 1e-5) and the same logged metrics; our models stream."""
    assert ours.stream_options["stream_chunk_size"] == CHUNK and is_streaming(ours.model)
    if ours.ref_model is not None:
        assert is_streaming(ours.accelerator.unwrap_model(ours.ref_model))
    assert set(update) == set(ref_update) and update
    for name, delta_ref in ref_update.items():
        err = ((update[name] - delta_ref).norm() / delta_ref.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{name}: relative error of the update {err:.2e}"
    ref_logs = [h for h in ref_trainer.state.log_history if "loss" in h]
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == len(ref_logs)
    for r, h in zip(ref_logs, logs, strict=True):
        for key, value in r.items():
            if key in ("epoch", "step", "learning_rate", "grad_norm") or not isinstance(value, float):
                continue
            if key.endswith("_time") or key.startswith("profiling/"):  # wall-clock timings
                continue
            assert abs(h[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, h[key], value)
