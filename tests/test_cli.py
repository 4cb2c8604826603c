"""The ``streambp-trl`` command end to end, and its errors for bad configs."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import MODEL, ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow  # each test runs the command line in a fresh process (~10 s of imports)


def _cli(*args, timeout=600, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _one_line_error(out, command: str = "sft") -> str:
    """The error of a command that failed with one line of its own on stderr and no traceback (a library may warn at
    import beside it: bitsandbytes, on a CPU with AVX512-BF16, that its optional ``kernels`` package is missing)."""
    assert out.returncode != 0
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("streambp-trl ")]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"streambp-trl {command}: error: "), out.stderr[-3000:]
    return lines[0]


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
    assert "Training on 1 process (cpu)" in out.stdout  # accelerate's distributed type in words ("NO": none)
    assert "is deprecated" not in out.stderr
    # DeepSpeed (the dev extra) told the CPU is meant (it logs on stdout), a CUDA build of torch without a GPU included
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr
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
    shipped = AutoModelForCausalLM.from_pretrained(MODEL)
    assert not torch.equal(model.lm_head.weight, shipped.lm_head.weight)  # it trained


def test_version_names_the_package_and_its_libraries():
    import transformers
    import trl

    from streambp_trl import __version__

    out = _cli("--version")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == (
        f"streambp-trl {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__})"
    )


def test_unknown_config_field_fails_before_training(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text((ROOT / "configs" / "sft_tiny.yaml").read_text() + "\nstream_chunk_sise: 64\n")
    assert _one_line_error(_cli("sft", "--config", str(config))) == (
        f"streambp-trl sft: error: unknown field in {config}: stream_chunk_sise (did you mean stream_chunk_size?); "
        "`streambp-trl sft --help` lists the options"
    )


def test_unknown_option_is_one_line_naming_it_and_the_closest(tmp_path):
    out = _sft_tiny(tmp_path, "--max_stepz", "2")
    assert _one_line_error(out) == (
        "streambp-trl sft: error: unknown option: --max_stepz (did you mean --max_steps?); "
        "`streambp-trl sft --help` lists the options"
    )
    assert "invalid int value: 'two'" in _one_line_error(_sft_tiny(tmp_path, "--max_steps", "two"))


def test_missing_config_file_is_one_line(tmp_path):
    out = _cli("sft", "--config", "configs/sft_tiny.yml", cwd=tmp_path)
    assert _one_line_error(out) == (
        f"streambp-trl sft: error: config file 'configs/sft_tiny.yml' not found (relative to {tmp_path}): give the "
        "path of a YAML file, e.g. --config configs/sft_tiny.yaml"
    )


def test_no_config_is_one_line_naming_the_tiny_config():
    """Without a config TRL's defaults would ask for bf16 and die on a CPU; the missing config is the problem."""
    line = _one_line_error(_cli("dpo"), "dpo")
    assert line.startswith("streambp-trl dpo: error: no config: give one, `streambp-trl dpo --config FILE.yaml` ")
    assert "configs/dpo_tiny.yaml trains a tiny model on a CPU" in line and "bf16" not in line


def test_hub_model_without_network_is_one_line(tmp_path):
    out = _sft_tiny(tmp_path, "--model_name_or_path", "Qwen/Qwen3-0.6B-Not-Cached")  # HF_HUB_OFFLINE=1 (conftest)
    assert _one_line_error(out) == (
        f"streambp-trl sft: error: model_name_or_path 'Qwen/Qwen3-0.6B-Not-Cached' is not a directory (relative to "
        f"{ROOT}) nor in the Hugging Face cache, and the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1): "
        "give a local directory, or download it once with network access (`hf download Qwen/Qwen3-0.6B-Not-Cached`)"
    )


def test_missing_data_file_is_one_line(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text((ROOT / "configs" / "sft_tiny.yaml").read_text().replace("tiny_chat.jsonl", "nope.jsonl"))
    line = _one_line_error(_cli("sft", "--config", str(config), "--model_name_or_path", str(MODEL)))
    assert line.startswith("streambp-trl sft: error: cannot load the dataset: Unable to find") and "nope.jsonl" in line


def test_a_max_length_that_drops_every_row_is_one_line(tmp_path):
    """Said once the trainer has prepared the data (after its progress bars), not as the sampler's traceback."""
    out = _sft_tiny(tmp_path, "--max_length", "16")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("streambp-trl sft: error: no training rows left: preparing split 'train' dropped every row")


def test_tiny_config_runs_from_another_directory_and_its_adapter_names_its_base_from_anywhere(tmp_path):
    """The config's inputs (tiny_model, data/...) are found next to it; the LoRA adapter saved by the run names its
    base model by an absolute path, not one relative to where the run started."""
    out = _cli(
        "sft", "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--use_peft", "true", "--max_steps", "1",
        "--output_dir", "out", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(MODEL)


def test_quantized_base_without_adapters_is_one_line_before_loading(tmp_path):
    """Quantized base weights train no more: TRL's --load_in_4bit needs --use_peft (QLoRA), said before any load."""
    out = _sft_tiny(tmp_path, "--load_in_4bit", "true")
    line = _one_line_error(out)
    assert "--load_in_4bit" in line and "--use_peft true" in line and "Loading weights" not in out.stderr


@pytest.mark.parametrize("value", ["0", "-8"])
def test_non_positive_chunk_size_fails(value):
    out = _cli("sft", "--config", "configs/sft_tiny.yaml", "--stream_chunk_size", value)
    assert out.returncode != 0 and "stream_chunk_size must be a positive integer" in out.stderr


def test_refused_model_fails_before_training(tmp_path):
    model_dir = tmp_path / "bidirectional"
    shutil.copytree(MODEL, model_dir)
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


@pytest.mark.parametrize(
    "config",
    [
        "dpo_qwen3_8b.yaml",
        "sft_qwen3_8b.yaml",
        "sft_qwen3_8b_qlora.yaml",
        "grpo_qwen3_8b.yaml",
        "sft_qwen3_5_9b_lora.yaml",
    ],
)
def test_hub_example_configs_parse(config):
    """The Hub examples cannot run offline; their fields must still all be known to the parser."""
    from streambp_trl.cli import parse_args

    _, training_args, model_args, _ = parse_args(
        config.split("_")[0], ["--config", str(ROOT / "configs" / config), "--use_cpu", "true", "--bf16", "false"]
    )
    assert model_args.model_name_or_path.startswith("Qwen/")
    assert training_args.stream_chunk_size in (4096, "auto") and not training_args.offload_checkpoints


@pytest.mark.parametrize(
    ("config", "objective", "shape"),
    [
        ("sft_qwen3_8b.yaml", "sft", "qwen3-8b"),
        ("sft_qwen3_8b_qlora.yaml", "sft", "qwen3-8b"),
        ("dpo_qwen3_8b.yaml", "dpo", "qwen3-8b"),
        ("grpo_qwen3_8b.yaml", "grpo", "qwen3-8b"),
        ("sft_qwen3_5_9b_lora.yaml", "sft", "qwen3.5-9b"),
    ],
)
def test_hub_example_configs_need_streaming(config, objective, shape):
    """Each Hub example trains at a length the memory model puts past TRL's default (checkpointing + its fused LM
    head) and within streaming (its layer inputs rebuilt where they no longer all fit), on the 80 GB card its comment
    names (78 GiB usable), as max-len estimates it: the base weights at their stored size, the optimizer's state
    held."""
    from streambp_trl.cli import parse_args
    from streambp_trl.sizing.lengths import max_len
    from streambp_trl.sizing.memory_model import StepSetup
    from streambp_trl.sizing.model_shape import ModelShape

    _, training_args, model_args, _ = parse_args(
        config.split("_")[0], ["--config", str(ROOT / "configs" / config), "--use_cpu", "true", "--bf16", "false"]
    )
    length = training_args.max_completion_length if objective == "grpo" else training_args.max_length
    model = ModelShape.from_name(shape)
    budget = 78 * 2**30
    setup = StepSetup(
        objective=objective,
        lora=model_args.use_peft,
        optimizer=training_args.optim,
        quantized="4bit" if model_args.load_in_4bit else None,
    )
    trl = max_len(model, dataclasses.replace(setup, mode="trl-default"), budget)
    stream = max_len(model, dataclasses.replace(setup, keep_every=5), budget)
    assert trl < length <= stream, (trl, length, stream)


def test_unknown_reward_function_fails_before_training(tmp_path):
    out = _cli("grpo", "--config", "configs/grpo_tiny.yaml", "--output_dir", str(tmp_path), "--reward_funcs", "nope")
    assert out.returncode != 0 and "Unknown reward function 'nope'" in out.stderr
    assert "'loss'" not in out.stdout + out.stderr


def test_a_step_that_fits_no_plan_is_one_line_naming_the_shape_and_the_lengths(tmp_path):
    """A memory_budget no way of running fits: before any step, the command exits with status 1 and one line naming
    the longest batch the config allows, the budget, the longest length each way allows and what one sequence per
    step fits; no traceback."""
    out = _sft_tiny(tmp_path, "--max_steps", "1", "--memory_budget", "4MiB")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "streambp-trl sft: error: StreamSFTTrainer, the longest batch of this config (per_device_train_batch_size=8, "
        "max_length=256): StreamBP: 8 x 256 tokens "
    ), last
    assert "fit in no way of running within memory_budget" in last
    assert "Longest lengths per sequence that would fit: as configured: " in last
    assert "(one sequence per step, a per-device batch size of 1, fits up to " in last


def test_the_plan_shows_at_log_level_info(tmp_path):
    """``--log_level info`` shows each new batch shape's plan in one line (above the progress bar)."""
    out = _sft_tiny(tmp_path, "--max_steps", "1", "--log_level", "info")
    assert out.returncode == 0, out.stderr[-3000:]
    plans = [line for line in out.stderr.splitlines() if "StreamBP plan for " in line]
    # (a tiny model on the CPU: room for every layer's activations)
    assert len(plans) == 1 and "chunk 32, every layer's activations kept" in plans[0], out.stderr[-3000:]
    quiet = _sft_tiny(tmp_path, "--max_steps", "1")
    assert "StreamBP plan for " not in quiet.stderr
