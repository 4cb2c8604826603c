"""StreamSFTTrainer against TRL's SFTTrainer on the same inputs: parameter updates, loss curves, resume, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import CHUNK, MODEL, args, assert_same_training, load_model, load_tokenizer, tiny_dataset, train
from models import tiny_model
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from streambp_trl import StreamOptions, StreamSFTConfig, StreamSFTTrainer
from streambp_trl.engine import is_streaming

SFT = {"max_length": 128}  # on top of helpers.args, for every trainer here


def _args(config_cls, output_dir, **overrides):
    return args(config_cls, output_dir, **{**SFT, **overrides})


def _dataset(kind: str = "chat"):
    return tiny_dataset(kind, 16)


def _train(trainer_cls, config_cls, tmp_path, kind="chat", **options):
    """``trainer_cls`` trained on ``_dataset(kind)`` (:func:`helpers.train`): the trainer and its update."""
    return train(trainer_cls, config_cls, tmp_path, _dataset(kind), **{**SFT, **options})


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n.replace("base_model.model.", ""): p.detach() for n, p in trainer.model.named_parameters()}


def _same(tmp_path, kind="chat", **options):
    """:func:`helpers.assert_same_training` against SFTTrainer, and the stored weights after the step agree up to
    float32 rounding of p + dp."""
    ref, ours = assert_same_training(
        (SFTTrainer, SFTConfig), (StreamSFTTrainer, StreamSFTConfig), tmp_path, _dataset(kind), **{**SFT, **options}
    )
    ref_weights = _weights(ref)
    for name, weight in _weights(ours).items():
        torch.testing.assert_close(weight, ref_weights[name], rtol=1e-6, atol=1e-6)
    return ref, ours


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("chat", {}),
        ("chat", {"loss_type": "dft"}),
        ("chat", {"assistant_only_loss": True}),
        ("prompt_completion", {}),  # completion_only_loss (TRL's default for prompt-completion data)
        ("text", {"packing": True, "max_length": 96}),  # bfd packing: padding-free, position_ids resets
        ("text", {"packing": True, "packing_strategy": "wrapped", "max_length": 64}),
        ("chat", {"padding_free": True, "max_length": None}),
        ("chat", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
        ("chat", {"stream_keep_every": 2}),
    ],
    ids=[
        "nll",
        "dft",
        "assistant_only",
        "completion_only",
        "packing_bfd",
        "packing_wrapped",
        "padding_free",
        "accum2",
        "keep_every2",
    ],
)
def test_one_step_equals_sft_trainer(tmp_path, kind, overrides):
    _same(tmp_path, kind, **overrides)


def test_lora_step_equals_sft_trainer(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    _same(tmp_path, "chat", peft_config=lora, learning_rate=0.5)


def test_lora_dropout_step_equals_sft_trainer_with_the_same_masks(tmp_path):
    """TRL's default LoRA dropout trains. With one chunk per sequence our forward draws its dropout masks in the same
    order as SFTTrainer's (checkpointed) forward, so both see the same masks and must give the same update; with
    many chunks the masks are drawn per chunk and replayed (tests/test_randomness.py)."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "up_proj"])
    _same(tmp_path, "chat", peft_config=lora, learning_rate=0.5, stream_chunk_size=4096)
    ours, _ = _train(StreamSFTTrainer, StreamSFTConfig, tmp_path / "chunked", "chat", peft_config=lora, max_steps=2)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in ours.state.log_history if "loss" in h)


def test_the_callers_config_is_not_changed(tmp_path):
    args = _args(StreamSFTConfig, tmp_path)
    assert args.gradient_checkpointing
    trainer = StreamSFTTrainer(
        model=load_model(),
        args=args,
        train_dataset=_dataset("chat"),
        processing_class=load_tokenizer(),
    )
    assert args.gradient_checkpointing and not trainer.args.gradient_checkpointing


@pytest.mark.slow
def test_loss_curve_equals_sft_trainer(tmp_path):
    kw = dict(max_steps=5, learning_rate=0.05)
    ref, _ = _train(SFTTrainer, SFTConfig, tmp_path, **kw)
    ours, _ = _train(StreamSFTTrainer, StreamSFTConfig, tmp_path, **kw)
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(ref_losses) == 5
    for r, h in zip(ref_losses, logs, strict=True):
        assert abs(h["loss"] - r) <= 1e-5 * abs(r)
    assert logs[0]["stream_chunk_size"] == CHUNK and logs[0]["logits_chunk_size"] == 5
    for key in ("mean_token_accuracy", "entropy", "num_tokens"):
        assert all(key in h for h in logs)


def test_plain_sft_config_gets_default_stream_options(tmp_path):
    trainer, _ = _train(StreamSFTTrainer, SFTConfig, tmp_path, max_length=4096)
    assert trainer.stream_options == StreamOptions(
        stream_chunk_size="auto", stream_eval=True, fused_outputs=("entropy", "is_top1"), token_mean_loss=True
    )
    assert not trainer.args.gradient_checkpointing  # the engine owns checkpointing: layers are not wrapped twice
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # "auto" on the CPU: rows this short take the smallest chunk, so nothing streams; the plan's fields say so
    assert logs[0]["stream_chunk_size"] == logs[0]["logits_chunk_size"] == 512
    assert logs[0]["stream_streamed"] == 0.0 and logs[0]["stream_inputs_rebuilt"] == 0
    assert logs[0]["stream_offload"] in (0.0, 1.0) and logs[0]["stream_kv_capture"] in (0.0, 1.0)
    assert logs[0]["stream_predicted_peak_gib"] > 0


@pytest.mark.slow
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    kw = dict(max_steps=4, learning_rate=0.05, save_strategy="steps", save_steps=2)
    full, _ = _train(StreamSFTTrainer, StreamSFTConfig, tmp_path / "full", **kw)
    full_after = _weights(full)
    model = load_model()
    args = _args(StreamSFTConfig, tmp_path / "full" / StreamSFTTrainer.__name__, **kw)
    resumed = StreamSFTTrainer(
        model=model, args=args, train_dataset=_dataset("chat"), processing_class=load_tokenizer()
    )
    resumed.train(resume_from_checkpoint=str(Path(args.output_dir) / "checkpoint-2"))
    assert is_streaming(resumed.model)  # the weights were reloaded into the streamed model
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p.detach(), full_after[name], rtol=1e-6, atol=1e-7)
    reloaded = AutoModelForCausalLM.from_pretrained(Path(args.output_dir) / "checkpoint-4")
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, full_after[name], rtol=0, atol=0)


def test_refused_model_fails_before_training(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.config.is_causal = False
    with pytest.raises(ValueError, match="Qwen3ForCausalLM .*bidirectional"):
        StreamSFTTrainer(
            model=model,
            args=_args(StreamSFTConfig, tmp_path),
            train_dataset=_dataset("chat"),
            processing_class=load_tokenizer(),
        )


@pytest.mark.parametrize("value", [0, -1, "big"])
def test_bad_chunk_size_in_config(tmp_path, value):
    with pytest.raises(ValueError, match="stream_chunk_size"):
        StreamSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, stream_chunk_size=value)


def test_moe_load_balancing_loss_is_refused_at_construction_and_trains_without_it(tmp_path):
    def build(**overrides):
        return StreamSFTTrainer(
            model=tiny_model("qwen3_moe", dtype=torch.float32, vocab_size=512),
            args=_args(StreamSFTConfig, tmp_path, **overrides),
            train_dataset=_dataset("chat"),
            processing_class=load_tokenizer(),
        )

    with pytest.raises(
        ValueError, match=r"load-balancing loss \(router_aux_loss_coef=0.001\).*router_aux_loss_coef=0.0"
    ):
        build()
    trainer = build(router_aux_loss_coef=0.0)
    trainer.train()
    assert is_streaming(trainer.model)
