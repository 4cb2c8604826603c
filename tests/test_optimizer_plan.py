"""A trainer's per-call plan counts the optimizer state from the first step: before the optimizer allocates it (its
first ``step()``, after the first backward) the plan reserves what ``TrainingArguments.optim`` will allocate, by the
rule max-len counts it by; once allocated it is counted as allocated, never twice. No network."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import args, load_model, load_tokenizer, tiny_dataset

from streambp_trl import StreamSFTConfig, StreamSFTTrainer
from streambp_trl.bench import max_len as ml
from streambp_trl.bench import plans
from streambp_trl.sizing import auto, optimizers
from streambp_trl.sizing.choices import MaskBlocks, PlanChoices

GiB = 2**30
LENGTHS = (65536, 131072, 212992)


def _qwen3_8b_on_meta():
    config = transformers.Qwen3Config(
        num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _plan_key(plan) -> tuple:
    return plan.chunk, plan.layout.every, plan.layout.drop, plan.offload, plan.kv_mode == "capture"


class _Owner:
    """What a trainer is to the plan: the holder of ``optimizer`` once built."""

    optimizer = None


def test_the_plan_reserves_the_state_max_len_counts_until_it_is_allocated(monkeypatch, capsys):
    """Qwen3-8B (bfloat16, on the meta device: no gradient held), 78 GiB, chunk 2048: a planner that counts AdamW
    (the default optim) plans what max-len plans with its default optimizer, and not what it plans without one; once
    the optimizer holds its state (and a CUDA device's allocation holds it too), the plans are the same."""
    monkeypatch.setattr(auto, "host_room", lambda: 20 * GiB)
    monkeypatch.setattr(plans, "host_room", lambda: 20 * GiB)
    argv = ["--model", "qwen3-8b", "--gpu-memory", "78GiB", "--chunk", "2048", "--lengths", *map(str, LENGTHS)]
    with_state = {row["tokens"]: row for row in ml.main(argv)["plans"]["rows"]}
    without = {row["tokens"]: row for row in ml.main([*argv, "--optimizer", "none"])["plans"]["rows"]}
    capsys.readouterr()

    def expected(row) -> tuple:
        layout = row["layout"]
        return row["chunk"], layout["every"], layout["drop"], row["offload"], row["capture"]

    model, owner = _qwen3_8b_on_meta(), _Owner()
    counted = auto.AutoChunks(model, PlanChoices(chunk=2048, budget=78 * GiB))
    counted.count_optimizer("adamw_torch_fused", owner)
    plain = auto.AutoChunks(model, PlanChoices(chunk=2048, budget=78 * GiB))
    params = sum(p.numel() for p in model.parameters())
    assert counted.optimizer_state() == (4 * params, 4 * params)  # two bfloat16 moments, none allocated yet
    meta = torch.device("meta")
    before = {n: _plan_key(counted.plan(1, n, meta)) for n in LENGTHS}
    assert before == {n: expected(with_state[n]) for n in LENGTHS}
    assert {n: _plan_key(plain.plan(1, n, meta)) for n in LENGTHS} == {n: expected(without[n]) for n in LENGTHS}
    assert before != {n: expected(without[n]) for n in LENGTHS}

    # the optimizer's first step allocates the state: counted as it is, nothing reserved besides it
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    owner.optimizer = optimizer
    assert counted.optimizer_state() == (4 * params, 0)
    assert {n: _plan_key(counted.plan(1, n, meta)) for n in LENGTHS} == before

    # a CUDA device's allocation holds the weights and then the state too: never counted twice
    weights = 2 * params
    for allocated, state in [(weights, None), (weights + 4 * params, optimizer)]:
        owner.optimizer = state
        replanned = auto.AutoChunks(model, PlanChoices(chunk=2048, budget=78 * GiB))
        replanned.count_optimizer("adamw", owner)
        monkeypatch.setattr(auto, "allocated_bytes", lambda device, allocated=allocated: allocated)
        assert {n: _plan_key(replanned.plan(1, n, meta)) for n in LENGTHS} == before


def test_a_trainer_counts_its_optim_until_the_first_step_allocates_it(tmp_path):
    """StreamSFTTrainer (tiny model, float32, adamw_torch, "auto" chunks): its plan counts AdamW's float32 moments of
    every weight before the first step, and the state the optimizer holds after it, nothing pending."""
    config = args(StreamSFTConfig, tmp_path, optim="adamw_torch", stream_chunk_size="auto", memory_budget="4GiB")
    trainer = StreamSFTTrainer(
        model=load_model(), args=config, train_dataset=tiny_dataset("text", 8), processing_class=load_tokenizer()
    )
    planner = trainer.model._streambp.auto
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    state = 8 * sum(p.numel() for p in params)
    assert planner.optim == "adamw_torch" and planner.optimizer_state() == (state, state)
    trainer.train()
    assert planner.optimizer_state() == (state, 0)
    assert optimizers.state_bytes(params, "adamw_torch", trainer.optimizer) == (state, 0)


def test_an_optimizer_the_model_does_not_size_is_counted_once_allocated(tmp_path):
    config = args(StreamSFTConfig, tmp_path, optim="galore_adamw", stream_chunk_size="auto", memory_budget="4GiB")
    trainer = StreamSFTTrainer.__new__(StreamSFTTrainer)  # (only the counting step, on an installed engine)
    trainer.args, trainer.model = config, load_model()
    from streambp_trl import enable_streambp

    enable_streambp(trainer.model, stream_chunk_size="auto", memory_budget="4GiB")
    trainer._count_optimizer_state()
    assert trainer.model._streambp.auto.optim is None


def test_an_optimizer_the_user_built_is_counted_once_allocated(tmp_path):
    """``optimizers=(...)`` (or ``optimizer_cls_and_kwargs``): ``args.optim`` does not describe it, so nothing is
    reserved by that name."""
    config = args(StreamSFTConfig, tmp_path, optim="adamw_torch", stream_chunk_size="auto", memory_budget="4GiB")
    model = load_model()
    trainer = StreamSFTTrainer(
        model=model,
        args=config,
        train_dataset=tiny_dataset("text", 8),
        processing_class=load_tokenizer(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    )
    assert trainer.model._streambp.auto.optim is None


def test_after_the_first_step_a_parameter_without_state_holds_none():
    """The first ``step()`` allocates every state it will: a trained parameter it left without one (no gradient
    reached it) is not reserved for ever."""
    used, unused = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(8, 8))
    optimizer = torch.optim.AdamW([used, unused])
    assert optimizers.state_bytes([used, unused], "adamw_torch", optimizer) == (8 * 80, 8 * 80)
    used.grad = torch.ones_like(used)
    optimizer.step()
    assert optimizers.state_bytes([used, unused], "adamw_torch", optimizer) == (8 * 16, 0)


def test_the_plan_of_a_lora_model_is_max_len_s(monkeypatch, capsys):
    """Qwen3-8B with LoRA (rank 16, every linear layer; on the meta device), 78 GiB, chunk 2048: the trainers' planner
    counts a layer's trained adapters as max-len's --lora does, so both plan the same at each length."""
    peft = __import__("pytest").importorskip("peft")
    monkeypatch.setattr(auto, "host_room", lambda: 20 * GiB)
    monkeypatch.setattr(plans, "host_room", lambda: 20 * GiB)
    lengths = (131072, 262144, 524288)
    argv = ["--model", "qwen3-8b", "--lora", "--gpu-memory", "78GiB", "--chunk", "2048"]
    rows = {row["tokens"]: row for row in ml.main([*argv, "--lengths", *map(str, lengths)])["plans"]["rows"]}
    capsys.readouterr()
    model = peft.get_peft_model(
        _qwen3_8b_on_meta(), peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    ).base_model.model
    counted = auto.AutoChunks(model, PlanChoices(chunk=2048, budget=78 * GiB))
    counted.count_optimizer("adamw_torch_fused", _Owner())
    meta = torch.device("meta")
    for n in lengths:
        layout = rows[n]["layout"]
        expected = rows[n]["chunk"], layout["every"], layout["drop"], rows[n]["offload"], rows[n]["capture"]
        assert _plan_key(counted.plan(1, n, meta)) == expected, n


def test_max_len_s_stream_rows_are_the_longest_the_trainers_plan(monkeypatch, capsys):
    """``max-len --model Qwen/Qwen3-8B --lora --objective dpo --gpu h100`` gave several answers: a stream row of
    109,568 (the memory model at the smallest chunk, no fragmentation margin), a footer "as configured: 107,520"
    (nothing was configured) and plans that went on to 325,632 keeping every 5th layer input. Each stream row is now
    the trainers' planner's answer (AutoChunks on Qwen3-8B with LoRA, its AdamW state counted, 78 GiB, 16 GiB of host
    memory): it plans the row's length as the row says, with the layout its label names, and refuses one step more;
    the footer and the plan table end at the same figures."""
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(auto, "host_room", lambda: 16 * GiB)
    monkeypatch.setattr(plans, "host_room", lambda: 16 * GiB)
    result = ml.main(["--model", "Qwen/Qwen3-8B", "--lora", "--objective", "dpo", "--gpu", "h100"])
    out = capsys.readouterr().out
    rows = {row["mode"]: row for row in result["rows"]}
    longest, planned = result["plans"]["longest"], {row["tokens"]: row for row in result["plans"]["rows"]}
    (footer,) = [line for line in out.splitlines() if line.startswith("Longest length per sequence")]
    assert "as configured" not in out and "every layer input kept: " in footer
    assert rows["stream"]["max_len"] == max(tokens for way, tokens in longest.items() if "offload" not in way)
    assert max(planned) == max(longest.values()) == max(row["max_len"] for row in rows.values())
    assert {rows["stream"]["max_len"], rows["stream+offload"]["max_len"]} <= planned.keys()
    model = peft.get_peft_model(
        _qwen3_8b_on_meta(), peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    ).base_model.model
    meta = torch.device("meta")
    for mode, offload in (("stream", False), ("stream+offload", True)):
        engine = auto.AutoChunks(model, PlanChoices(offload=offload, budget=78 * GiB))
        engine.count_optimizer("adamw_torch_fused", _Owner())
        n = rows[mode]["max_len"]
        padded = MaskBlocks(whole=True)  # (DPO: the chosen and the rejected sequence, padded to the longer)
        plan = engine.plan(2, n, meta, masks=padded)
        assert plan.describe(n, 36) == rows[mode]["plan"], mode
        assert plan.layout.describe(36) in rows[mode]["label"] and plan.layout.rebuilt(36), mode
        with pytest.raises(auto.NoPlanFits):
            engine.plan(2, n + 1024, meta, masks=padded)
