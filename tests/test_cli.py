"""The ``streambp-trl`` command end to end, and its errors for bad configs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _sft_tiny(output_dir, *extra):
    return _cli("sft", "--config", "configs/sft_tiny.yaml", "--output_dir", str(output_dir), *extra)


def test_help_lists_commands():
    out = _cli("--help")
    assert out.returncode == 0 and "sft" in out.stdout


def test_tiny_config_trains_and_saves_a_plain_transformers_model(tmp_path):
    out = _sft_tiny(tmp_path, "--max_steps", "4", "--logging_steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Model saved to {tmp_path}" in out.stdout + out.stderr
    assert "'stream_chunk_size': 32" in out.stdout + out.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    shipped = AutoModelForCausalLM.from_pretrained(ROOT / "configs" / "tiny_model")
    assert not torch.equal(model.lm_head.weight, shipped.lm_head.weight)  # it trained


def test_unknown_config_field_fails_before_training(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text((ROOT / "configs" / "sft_tiny.yaml").read_text() + "\nstream_chunk_sise: 64\n")
    out = _cli("sft", "--config", str(config))
    assert out.returncode != 0 and "stream_chunk_sise" in out.stderr


@pytest.mark.parametrize("value", ["0", "-8"])
def test_non_positive_chunk_size_fails(value):
    out = _cli("sft", "--config", "configs/sft_tiny.yaml", "--stream_chunk_size", value)
    assert out.returncode != 0 and "`stream_chunk_size` must be a positive integer" in out.stderr


def test_refused_model_fails_before_training(tmp_path):
    model_dir = tmp_path / "bidirectional"
    shutil.copytree(ROOT / "configs" / "tiny_model", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    out = _sft_tiny(tmp_path / "out", "--model_name_or_path", str(model_dir))
    assert out.returncode != 0 and "Qwen3ForCausalLM exactly: its attention is bidirectional" in out.stderr
    assert "'loss'" not in out.stdout + out.stderr


def test_eval_without_a_test_split_says_what_to_do(tmp_path):
    out = _sft_tiny(tmp_path, "--eval_strategy", "steps", "--max_steps", "1")
    assert out.returncode != 0
    assert "eval_strategy='steps' needs an evaluation split, but the dataset has no split 'test'" in out.stderr
    assert "dataset_test_split" in out.stderr and "KeyError" not in out.stderr


@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo", "rloo"])
def test_tiny_configs_of_every_objective_train_and_save(tmp_path, objective):
    out = _cli(
        objective, "--config", f"configs/{objective}_tiny.yaml", "--output_dir", str(tmp_path), "--max_steps", "4",
        "--logging_steps", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Model saved to {tmp_path}" in out.stdout + out.stderr
    logged = "'rewards/margins'" if objective in ("dpo", "kto") else "'rewards/length_reward/mean'"
    assert logged in out.stdout + out.stderr and "'stream_chunk_size': 16" in out.stdout + out.stderr
    AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("config", ["dpo_qwen3_8b.yaml", "sft_qwen3_8b.yaml", "grpo_qwen3_4b.yaml"])
def test_hub_example_configs_parse(config):
    """The Hub examples cannot run offline; their fields must still all be known to the parser."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from streambp_trl.cli import RewardScriptArguments, _objective

    config_cls, _ = _objective(config.split("_")[0])
    parser = TrlParser((RewardScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig))
    _, training_args, model_args, _ = parser.parse_args_and_config(
        ["--config", str(ROOT / "configs" / config), "--use_cpu", "true", "--bf16", "false"]
    )
    assert model_args.model_name_or_path.startswith("Qwen/")
    assert training_args.stream_chunk_size in (4096, "auto") and not training_args.offload_checkpoints


def test_unknown_reward_function_fails_before_training(tmp_path):
    out = _cli("grpo", "--config", "configs/grpo_tiny.yaml", "--output_dir", str(tmp_path), "--reward_funcs", "nope")
    assert out.returncode != 0 and "Unknown reward function 'nope'" in out.stderr
    assert "'loss'" not in out.stdout + out.stderr
