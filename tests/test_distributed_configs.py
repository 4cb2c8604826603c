"""The shipped accelerate / DeepSpeed configs (configs/accelerate) parse and say what the README says, context and
sequence parallelism are served by the trainers that say how their rows reach the ranks (refused by another when it is
built), and ZeRO-3 gets the decoder layers as leaf modules."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedPlugin, DistributedType
from helpers import ROOT, max_rel_grad_error, reference_loss
from models import batch, tiny_model

from streambp_trl.trainers.mixin import _sequence_split

CONFIGS = ROOT / "configs" / "accelerate"


def _load(name: str) -> ClusterConfig:
    return ClusterConfig.from_yaml_file(str(CONFIGS / f"{name}.yaml"))


def test_every_config_file_is_tested():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(
        [f"{n}.yaml" for n in ("ddp", "fsdp2", "fsdp2_cp", "zero2", "zero3", "zero3_offload", "zero3_sp")]
        + [f"{n}.json" for n in ("zero2", "zero3", "zero3_offload")]
    )


def test_ddp_and_fsdp2_configs():
    assert _load("ddp").distributed_type == DistributedType.MULTI_GPU
    for name in ("fsdp2", "fsdp2_cp"):
        fsdp = _load(name)
        assert fsdp.distributed_type == DistributedType.FSDP
        assert fsdp.fsdp_config["fsdp_version"] == 2
        assert fsdp.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp.fsdp_config["fsdp_activation_checkpointing"] is False  # the engine checkpoints the layers
    assert _load("fsdp2").parallelism_config == {}
    split = _load("fsdp2_cp").parallelism_config  # context parallelism over every GPU
    assert split == {
        "parallelism_config_dp_shard_size": 1,
        "parallelism_config_cp_size": _load("fsdp2_cp").num_processes,
    }


@pytest.mark.parametrize(
    "name, stage, offload, processes",
    [("zero2", 2, False, 8), ("zero3", 3, False, 8), ("zero3_offload", 3, True, 1), ("zero3_sp", 3, False, 8)],
)
def test_deepspeed_configs(monkeypatch, name, stage, offload, processes):
    config = _load(name)
    assert config.distributed_type == DistributedType.DEEPSPEED and config.num_processes == processes
    path = config.deepspeed_config["deepspeed_config_file"]
    assert (ROOT / path).resolve() == (CONFIGS / f"{name.removesuffix('_sp')}.json").resolve()
    split = config.parallelism_config  # zero3_sp alone splits each sequence, over every GPU (DeepSpeed's split)
    if name == "zero3_sp":
        assert (
            split["parallelism_config_sp_size"] == processes and split["parallelism_config_sp_backend"] == "deepspeed"
        )
        assert split["parallelism_config_dp_replicate_size"] == 1
    else:
        assert split == {}
    assert config.deepspeed_config["zero3_init_flag"] is (stage == 3)
    monkeypatch.chdir(ROOT)  # the file path is relative to the repository root, where the README launches from
    plugin = DeepSpeedPlugin(hf_ds_config=path)
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == stage and zero["stage"] == stage
    for key in ("offload_param", "offload_optimizer"):
        assert (zero.get(key, {}).get("device") == "cpu") is offload
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"  # the Trainer fills in max_grad_norm etc.
    shipped = json.loads(Path(CONFIGS / f"{name.removesuffix('_sp')}.json").read_text())
    assert shipped.items() <= plugin.deepspeed_config.items()  # accelerate only adds its defaults


def test_readme_launches_the_shipped_configs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Multi-GPU", 1)[1].split("\n## ", 1)[0]
    for name in ("ddp", "fsdp2", "fsdp2_cp", "zero2", "zero3", "zero3_offload", "zero3_sp"):
        assert f"accelerate launch --config_file configs/accelerate/{name}.yaml" in section, name
    assert yaml.safe_load((ROOT / "configs" / "sft_qwen3_8b.yaml").read_text())  # the config the commands name


def test_sequence_splits_are_served_by_trainers_that_say_how_and_refused_by_others():
    """DeepSpeed's sequence parallelism (sp_size) and FSDP2's context parallelism (cp_size), in the config or on the
    accelerator (as an accelerate YAML sets them), are served by the trainers that say how their rows reach the ranks
    (every stream trainer: SFT shares, the others whole rows; tests/test_sequence_split.py trains with each) over
    DeepSpeed's sequence-parallel group or the device mesh's "cp" group; refused by another, naming the fix."""
    from streambp_trl.trainers.sequence_rows import deepspeed_sequence_group

    mesh = {"cp": SimpleNamespace(get_group=lambda: "the cp group")}
    sft = functools.partial(SimpleNamespace, sequence_rows="shares", args=SimpleNamespace())
    unserved = functools.partial(SimpleNamespace, sequence_rows=None, args=SimpleNamespace())
    deepspeed = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    assert _sequence_split(sft(accelerator=SimpleNamespace(parallelism_config=deepspeed))) == (
        2,
        deepspeed_sequence_group,
    )
    context = SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=4), torch_device_mesh=mesh)
    split, group = _sequence_split(sft(accelerator=context))
    assert split == 4 and group() == "the cp group"
    for accelerator in (SimpleNamespace(parallelism_config=deepspeed), context):
        with pytest.raises(ValueError, match=r"which SimpleNamespace does not\. Set cp_size=1 and sp_size=1"):
            _sequence_split(unserved(accelerator=accelerator))
    assert _sequence_split(sft(args=SimpleNamespace(parallelism_config=ParallelismConfig()))) == (1, None)


def test_zero3_marks_the_decoder_layers_as_leaf_modules_and_the_mark_survives():
    """Under ZeRO-3 (transformers' DeepSpeed config says stage 3) enable_streambp makes every decoder layer a ZeRO-3
    leaf module; the flag is DeepSpeed's and stays through disable_streambp and deepcopy, and the layers still train
    exactly (one process, no DeepSpeed engine)."""
    import copy

    pytest.importorskip("deepspeed")
    import torch
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from streambp_trl import disable_streambp, enable_streambp

    plain = tiny_model("qwen3", dtype=torch.float64)
    model = tiny_model("qwen3", dtype=torch.float64)
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        enable_streambp(model, stream_chunk_size=5)
    finally:
        unset_hf_deepspeed_config()
    del config
    assert all(layer._z3_leaf for layer in model.model.layers)
    assert all(layer._z3_leaf for layer in copy.deepcopy(model).model.layers)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    reference_loss(plain, ids, mask, labels).backward()
    err, name = max_rel_grad_error(plain, model)
    assert err < 1e-10, (name, err)
    disable_streambp(model)
    assert all(layer._z3_leaf for layer in model.model.layers)
