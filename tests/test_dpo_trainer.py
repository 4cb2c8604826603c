"""StreamDPOTrainer against TRL's DPOTrainer on the same inputs: parameter updates, metrics and loss curves for every
loss type and reference setup TRL 1.16 offers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from datasets import load_dataset
from test_memory_shapes import _Shapes
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

from streambp_trl import StreamDPOConfig, StreamDPOTrainer
from streambp_trl.engine import is_streaming

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "configs" / "tiny_model"
CHUNK = 8  # far below the sequence lengths, so every layer really streams

LOSS_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


def _dataset(n: int = 8):
    return load_dataset("json", data_files=str(ROOT / "configs/data/tiny_preference.jsonl"), split=f"train[:{n}]")


def _args(config_cls, output_dir, **overrides):
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
    if config_cls is StreamDPOConfig:
        base.update(stream_chunk_size=CHUNK, logits_chunk_size=5)
    return config_cls(**{**base, **overrides})


class _RecordUpdate(TrainerCallback):
    """The update SGD applies, -lr * grad, taken before it is added to the float32 weights."""

    def __init__(self):
        self.update: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.update = {
            n.replace("base_model.model.", ""): -args.learning_rate * p.grad.detach().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }


def _train(trainer_cls, config_cls, output_dir, ref="created", peft_config=None, **overrides):
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32) if ref == "given" else None
    record = _RecordUpdate()
    trainer = trainer_cls(
        model=model,
        ref_model=ref_model,
        args=_args(config_cls, Path(output_dir) / trainer_cls.__name__, **overrides),
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
        peft_config=copy.deepcopy(peft_config),
        callbacks=[record],
    )
    trainer.train()
    return trainer, record.update


def _assert_same(tmp_path, ref="created", peft_config=None, **overrides):
    ref_trainer, ref_update = _train(DPOTrainer, DPOConfig, tmp_path, ref, peft_config, **overrides)
    ours, update = _train(StreamDPOTrainer, StreamDPOConfig, tmp_path, ref, peft_config, **overrides)
    assert ours.stream_options["stream_chunk_size"] == CHUNK and is_streaming(ours.model)
    if ours.ref_model is not None:
        assert is_streaming(ours.accelerator.unwrap_model(ours.ref_model))
    assert set(update) == set(ref_update) and update
    for name, delta_ref in ref_update.items():
        err = ((update[name] - delta_ref).norm() / delta_ref.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{name}: relative error of the update {err:.2e}"
    # every metric TRL logs, with the same value
    ref_logs = [h for h in ref_trainer.state.log_history if "loss" in h]
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == len(ref_logs)
    for r, h in zip(ref_logs, logs, strict=True):
        for key, value in r.items():
            if key in ("epoch", "step", "learning_rate", "grad_norm") or not isinstance(value, float):
                continue
            assert abs(h[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, h[key], value)
    return ref_trainer, ours


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_step_equals_dpo_trainer_for_every_loss_type(tmp_path, loss_type):
    extra = {"label_smoothing": 1e-3} if loss_type == "exo_pair" else {}  # TRL requires it for EXO
    _assert_same(tmp_path, loss_type=[loss_type], **extra)


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},  # MPO-style combination
        {"use_weighting": True},  # WPO
        {"ld_alpha": 0.5},
        {"label_smoothing": 0.1, "loss_type": ["robust"]},
        {"f_divergence_type": "js_divergence"},
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"precompute_ref_log_probs": True},
    ],
    ids=[
        "weighted_combination",
        "use_weighting",
        "ld_alpha",
        "label_smoothing",
        "js_divergence",
        "accum2",
        "precompute",
    ],
)
def test_one_step_equals_dpo_trainer_with_options(tmp_path, overrides):
    _assert_same(tmp_path, **overrides)


def test_given_ref_model(tmp_path):
    _assert_same(tmp_path, ref="given", beta=0.5)


def test_lora_reference_is_the_adapter_disabled_policy(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    ref_trainer, ours = _assert_same(tmp_path, peft_config=lora, learning_rate=0.5, max_steps=2)
    assert ours.ref_model is None


def test_loss_curve_equals_dpo_trainer(tmp_path):
    ref_trainer, ours = _assert_same(
        tmp_path, max_steps=4, learning_rate=0.05, sync_ref_model=True, ref_model_sync_steps=2
    )
    assert len([h for h in ours.state.log_history if "loss" in h]) == 4


class _ShapesEveryStep(TrainerCallback):
    """Records every tensor shape produced during the training steps, and whether both models still stream after
    each step."""

    def __init__(self):
        self.recorder, self.streaming = _Shapes(), []

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.__enter__()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.recorder.__exit__(None, None, None)
        self.streaming.append(is_streaming(model))


def test_three_steps_build_no_full_mask_or_logits_reference_passes_included(tmp_path):
    """Pairs of ~210 tokens in chunks of 16: no tensor with two dimensions of at least 150 in any of three steps
    (policy and reference passes), so no (T x T) mask or score and no (tokens x vocab) logits (vocab 512, widest other
    weight dimension 128)."""
    sentence = " The first letter of the word is the one it starts with, and we count from there."
    rows = [
        {
            "prompt": f"Question: {i} {sentence * 2}\nAnswer:",
            "chosen": sentence * 9,
            "rejected": f" {i}" + sentence * 8,
        }
        for i in range(3)
    ]
    from datasets import Dataset

    record = _ShapesEveryStep()
    trainer = StreamDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        args=_args(
            StreamDPOConfig,
            tmp_path,
            max_steps=3,
            per_device_train_batch_size=1,
            max_length=None,
            stream_chunk_size=16,
            logits_chunk_size=16,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
        callbacks=[record],
    )
    trainer.train()
    assert record.streaming == [True] * 3 and is_streaming(trainer.accelerator.unwrap_model(trainer.ref_model))
    lengths = {shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"}
    assert lengths and min(lengths) >= 200  # the rows really are long, for the policy and the reference
    assert [(op, s) for op, s in record.recorder.shapes if sum(d >= 150 for d in s) >= 2] == []
