"""One sequence split across CPU processes (gloo), streamed on each (``enable_streambp(..., sequence_group=...)``):
the loss and every gradient, summed over the ranks, equal one process's plain autograd on the whole rows, in float64
(tests/sequence_split_step.py runs both)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXACT, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASES = {
    # (ranks, tokens per rank, chunk, family, further arguments)
    "dense GQA, 2 ranks": (2, 6, 4, "qwen3", ()),
    "keys/values captured, attention outputs kept": (2, 6, 4, "qwen3", ("--kv-mode", "capture", "--keep-attention")),
    "one chunk per rank": (2, 6, 6, "llama", ()),
    "sliding window across the ranks' boundary": (2, 6, 4, "mistral", ()),
    "sliding and full layers, softcapped logits": (2, 6, 4, "gemma3", ()),
    "GQA with fewer key/value heads than ranks": (4, 5, 2, "qwen3", ()),
    "window over two earlier ranks": (4, 3, 2, "mistral", ()),
    "left and right padding across ranks": (2, 6, 4, "qwen3", ("--padding",)),
    "padding on every rank, a window": (4, 3, 2, "mistral", ("--padding",)),
    "packed rows, documents starting inside and at a rank's share": (2, 6, 4, "qwen3", ("--packed",)),
    "packed rows, a window, 4 ranks": (4, 3, 2, "mistral", ("--packed",)),
    "packed rows, flash attention (documents apart by its kernel)": (2, 6, 4, "qwen3", ("--packed", "--flash")),
    "compiled layers (torch_compile)": (2, 6, 4, "qwen3", ("--compile",)),
    "compiled layers, a window, padding, 4 ranks": (4, 3, 2, "mistral", ("--compile", "--padding")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_sequence_equals_one_process(tmp_path, case):
    ranks, per_rank, chunk, family, extra = CASES[case]
    out = tmp_path / "out.json"
    args = ("--family", family, "--per-rank", str(per_rank), "--chunk", str(chunk), *extra, "--out", str(out))
    torchrun("sequence_split_step.py", *args, log=tmp_path / "log", nproc=ranks)
    result = json.loads(out.read_text())
    assert abs(result["loss"] - result["reference_loss"]) <= EXACT * abs(result["reference_loss"])
    assert result["error"] < EXACT, f"relative gradient error {result['error']:.3e} at {result['where']}"
    # per layer, keys and values each in ranks - 1 rounds of point-to-point exchanges: gathered in the forward (and
    # again in a recomputing backward), their gradients returned once; the padding mask all-gathered once a call
    passes = 2 if "capture" in extra else 3
    rounds = 3 * 2 * (ranks - 1) * passes  # (3 layers)
    gathered = int("--padding" in extra or "--packed" in extra)  # the padding mask, or packed rows' positions
    assert result["collectives"] == {"all_gather": gathered, "batch_isend_irecv": rounds}
    assert (result["compiled_graphs"] > 0) == ("--compile" in extra)


WHOLE = {
    # (ranks, tokens per rank (the rows one short of it times the ranks), family, loss)
    "the model's own loss, 2 ranks": (2, 6, "qwen3", "nll"),
    "a preference loss over summed log-probs, 2 ranks": (2, 6, "qwen3", "pairs"),
    "a preference loss, a window over two earlier ranks, 4 ranks": (4, 3, "mistral", "pairs"),
    "a sequence classifier's scores, a row ending in padding, 2 ranks": (2, 4, "qwen3", "score"),
    "a sequence classifier's scores, 4 ranks": (4, 4, "qwen3", "score"),
    "packed rows, the model's own loss, 2 ranks": (2, 6, "qwen3", "nll", "--packed"),
    "packed rows, a preference loss, a window, 4 ranks": (4, 3, "mistral", "pairs", "--packed"),
    "packed rows with use_cache on (across the documents), 2 ranks": (2, 6, "qwen3", "pairs", "--packed", "--cached"),
}


@pytest.mark.parametrize("case", list(WHOLE))
def test_whole_rows_on_every_rank_equal_one_process(tmp_path, case):
    """enable_streambp(whole_rows=True): every rank is given the whole rows (their length no multiple of the ranks),
    streams its share and gathers the per-token outputs back (a sequence classifier: each row's score is read on the
    rank holding its last token, and summed over the ranks), so a loss over whole sequences (a preference loss on
    fused_lm_head=True's log-probs, or on scores) runs on every rank as on one process; the gradients averaged over
    the ranks equal plain autograd's on the whole rows."""
    ranks, per_rank, family, loss, *extra = WHOLE[case]  # (a cache built: no packed rows read, on one process too)
    out = tmp_path / "out.json"
    args = ("--family", family, "--per-rank", str(per_rank), "--chunk", "2", "--whole-rows", loss, *extra)
    args = (*args, "--out", str(out))
    torchrun("sequence_split_step.py", *args, log=tmp_path / "log", nproc=ranks)
    result = json.loads(out.read_text())
    assert abs(result["loss"] - result["reference_loss"]) <= EXACT * abs(result["reference_loss"])
    assert result["error"] < EXACT, f"relative gradient error {result['error']:.3e} at {result['where']}"


QLORA = {
    # (ranks, tokens per rank, chunk, further arguments)
    "shares, 2 ranks": (2, 6, 4, ()),
    "shares with padding across the ranks, 4 ranks": (4, 3, 2, ("--padding",)),
    "whole rows, a preference loss, 2 ranks": (2, 6, 2, ("--whole-rows", "pairs")),
}
FLOAT32_BOUND = 1e-5  # tests/test_quantized.py's: bitsandbytes computes in float32 (seen: 6e-7 to 1.9e-6)


@pytest.mark.parametrize("case", list(QLORA))
def test_qlora_split_across_ranks_equals_plain_autograd(tmp_path, case):
    """QLoRA (the tiny checkpoint's NF4 base weights, LoRA on every linear layer, float32 compute) split across the
    ranks, as each rank's share or with whole rows on every rank: the loss and the LoRA gradients (summed, or averaged,
    over the ranks) equal plain autograd's on the whole rows of the same quantized model."""
    ranks, per_rank, chunk, extra = QLORA[case]
    out = tmp_path / "out.json"
    args = ("--qlora", "--per-rank", str(per_rank), "--chunk", str(chunk), *extra, "--out", str(out))
    torchrun("sequence_split_step.py", *args, log=tmp_path / "log", nproc=ranks)
    result = json.loads(out.read_text())
    assert abs(result["loss"] - result["reference_loss"]) <= FLOAT32_BOUND * abs(result["reference_loss"])
    assert result["error"] < FLOAT32_BOUND, f"relative gradient error {result['error']:.3e} at {result['where']}"
    assert "lora" in result["where"]  # (the trained parameters alone are compared: the adapters')


def test_split_with_dropout_is_the_gradient_of_the_loss_it_returned(tmp_path):
    """Attention dropout: each chunk's masks are drawn once per forward and replayed by the collecting passes and the
    recompute, so the summed gradient is the derivative of the loss the split forward returns (against extrapolated
    central differences of that loss, its masks drawn alike: float64 accuracy ~1e-10; a mask not replayed is off by
    order one)."""
    out = tmp_path / "out.json"
    torchrun("sequence_split_step.py", "--dropout", "0.2", "--out", str(out), log=tmp_path / "log")
    result = json.loads(out.read_text())
    assert abs(result["along"] - result["difference"]) <= 1e-8 * abs(result["along"])


def test_split_refusals_name_the_problem_and_the_fix(tmp_path):
    out = tmp_path / "out.json"
    torchrun("sequence_split_step.py", "--refusals", "--out", str(out), log=tmp_path / "log")
    said = json.loads(out.read_text())
    assert "Qwen3_5DecoderLayer" in said["hybrid"] and "RecurrentMixers" in said["hybrid"]
    assert "without sequence_group" in said["hybrid"]
    assert "4D attention mask" in said["4D mask"] and "without the sequence split" in said["4D mask"]
    assert "shift_labels" in said["labels"] and "num_items_in_batch" in said["labels"]
    assert "different lengths (4 to 6 tokens)" in said["lengths"] and "pad_to_multiple_of" in said["lengths"]
    assert "different numbers of rows (1 to 2)" in said["rows"] and "per_device_train_batch_size" in said["rows"]
    assert "position_ids are given on some" in said["positions"] and "or on none" in said["positions"]
    assert said["a mask on one rank"] == "accepted"  # (its padding joined with the other rank's rows, all ones)
    assert "cu_seq_lens_q" in said["descriptors"] and "global position_ids alone" in said["descriptors"]
    assert "start at different positions" in said["rows apart"] and "padding_free=True" in said["rows apart"]
    flash = said["flash, a mask"]
    assert "given with an attention mask" in flash and "without attention_mask" in flash
    assert "Llama4TextModel's chunked attention" in said["chunked"] and "padded rows" in said["chunked"]


def _rounding(a: dict, b: dict) -> float:
    """The largest difference of two runs' weights after their steps, in float32 epsilons of each tensor's largest
    weight: what float32 rounding of the weights over the steps explains is a few."""
    eps = torch.finfo(torch.float32).eps
    return max(((a[n] - b[n]).abs().max() / (eps * a[n].abs().max())).item() for n in a)


def _trained(tmp_path, name: str, *flags: str, ranks: int = 2) -> dict:
    out = tmp_path / f"{name}.pt"
    torchrun("sequence_split_trainer.py", *flags, "--out", str(out), log=tmp_path / f"{name}.log", nproc=ranks)
    return torch.load(out)


# whether each streamed decoder call an objective splits runs with grad (the policy's loss) or without (a reference's
# pass, or the policy's own no-grad one: KTO's KL rows, RLOO's old log-probs): two SGD steps (online: one, its samples
# alike in every run)
SPLIT_CALLS = {
    "sft": (True,) * 2,
    "dpo": (True, False) * 2,  # the policy, then the reference model
    "kto": (False, True, False, False) * 2,  # the policy's KL rows, its loss, the reference's rows and KL rows
    "reward": (True,) * 2,
    "grpo": (True,),  # (beta=0: no reference)
    "rloo": (False, False, True),  # the policy's old log-probs, the reference's, the loss
}


@pytest.mark.parametrize("objective", list(SPLIT_CALLS))
def test_stream_trainers_under_deepspeed_sequence_parallelism_train_as_one_process(tmp_path, objective):
    """Every stream trainer but distillation configured as TRL's users set sequence parallelism (DeepSpeed's
    sp_size=2, ZeRO-3, tests/sequence_split_trainer.py; GRPO and RLOO as `accelerate launch` hands it over, in the
    environment): each rank streams half of every row in every pass, the reference model's no-grad passes included
    (the engine's split calls, recorded: SFT's rows reach the ranks as DeepSpeed's shares, the others' whole: DPO's
    chosen and rejected rows, KTO's KL rows, the reward model's pairs, the online trainers' generated completions, the
    group's first rank's), and the steps log the losses of one
    process training the same rows without the split (the online ones: from the same completions), its weights after
    them to float32 rounding (1-2 epsilons of each tensor's largest weight)."""
    split = _trained(tmp_path, "split", "--objective", objective)
    one = _trained(tmp_path, "one", "--objective", objective, "--world-one", ranks=1)
    tokens = split["splits"][0][2]
    assert split["splits"] == [(0, 2, tokens, grad) for grad in SPLIT_CALLS[objective]] and one["splits"] == []
    # whole rows: DeepSpeed's Ulysses attention (for shares of rows) is taken back out of transformers' registry
    assert split["own_sdpa"] is (objective != "sft") and one["own_sdpa"]
    assert split["completions"] == one["completions"]
    assert objective not in ("grpo", "rloo") or len(set(split["completions"])) > 1
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-12)
    assert _rounding(one["after"], split["after"]) < 4


@pytest.mark.parametrize("objective", list(SPLIT_CALLS))
def test_stream_trainers_under_fsdp2_context_parallelism_train_as_one_process(tmp_path, objective):
    """Every stream trainer but distillation (its command below) under FSDP2 with context parallelism (cp_size=2, as
    TRL's users set it: tests/sequence_split_trainer.py --cp): accelerate hands both ranks the same batches; SFT's
    rows reach them as the shares the trainer cuts, the others' whole; the engine's own exchange replaces torch's ring
    attention (accelerate's hooks dropping the attention modules' masks are not attached). Each rank streams half of
    every row in every pass, and the steps log the losses of one process on the same rows, its weights after them to
    float32 rounding (seen: 0.8 to 2.1 epsilons of each tensor's largest weight)."""
    split = _trained(tmp_path, "split", "--cp", "--objective", objective)
    one = _trained(tmp_path, "one", "--objective", objective, "--world-one", ranks=1)
    tokens = split["splits"][0][2]
    assert split["splits"] == [(0, 2, tokens, grad) for grad in SPLIT_CALLS[objective]] and one["splits"] == []
    assert split["attention_hooks"] == 0 and split["own_sdpa"]
    assert split["completions"] == one["completions"]
    assert objective not in ("grpo", "rloo") or len(set(split["completions"])) > 1
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-12)
    assert _rounding(one["after"], split["after"]) < 4


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_sliding_window_model_under_context_parallelism_trains_as_one_process(tmp_path, objective):
    """The tiny Qwen3 with a sliding window of 4 keys in every layer (``--window 4``), SFT and DPO (padded chosen and
    rejected rows) under FSDP2 with cp_size=2: accelerate refuses sliding-window models in its own context-parallel
    preparation, which the trainers do not attach; each rank's first queries attend across the share boundary within
    the window. The losses and weights are one process's with the same window (seen: losses to 8e-8, weights 2.8 and
    1.0 epsilons of each tensor's largest), which the window changes (the update without it is far from both)."""
    flags = ("--objective", objective, "--window", "4")
    split = _trained(tmp_path, "split", "--cp", *flags)
    one = _trained(tmp_path, "one", *flags, "--world-one", ranks=1)
    full = _trained(tmp_path, "full", "--objective", objective, "--world-one", ranks=1)
    assert split["splits"] == [(0, 2, split["splits"][0][2], grad) for grad in SPLIT_CALLS[objective]]
    assert split["attention_hooks"] == 0
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-12)
    assert _rounding(one["after"], split["after"]) < 4 < 100 < _rounding(full["after"], one["after"])


def test_stream_sft_under_context_parallelism_pads_the_rows_and_evaluates_as_one_process(tmp_path):
    """SFT rows of an odd length (no pad_to_multiple_of) under cp_size=2: the trainer pads them with masked, unscored
    positions before cutting the shares; evaluation (TRL's own prediction step) streams each rank's rows whole. The
    losses, eval losses and weights are one process's (seen: 3.4 epsilons of each tensor's largest weight)."""
    flags = ("--any-length", "--eval")
    split = _trained(tmp_path, "split", "--cp", *flags)
    one = _trained(tmp_path, "one", *flags, "--world-one", ranks=1)
    assert split["splits"] == [(0, 2, split["splits"][0][2], True)] * 2  # (the training steps' alone)
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert len(split["eval_losses"]) == 2 and split["eval_losses"] == pytest.approx(one["eval_losses"], rel=1e-6)
    assert _rounding(one["after"], split["after"]) < 8


def test_stream_sft_under_the_split_trains_as_trls_ulysses_sft(tmp_path):
    """The same two SFT steps as TRL's own SFTTrainer under DeepSpeed's Ulysses attention: the same losses, the
    weights to float32 rounding (seen: 5 epsilons of each tensor's largest weight)."""
    split = _trained(tmp_path, "split")
    trl = _trained(tmp_path, "trl", "--trainer", "trl")
    assert trl["splits"] == [] and split["losses"] == pytest.approx(trl["losses"], rel=1e-6)
    assert _rounding(trl["after"], split["after"]) < 8


@pytest.mark.parametrize("rows", ["--padding-free", "--packing"])
def test_stream_sft_on_padding_free_rows_under_the_split_trains_as_one_process(tmp_path, rows):
    """padding_free=True or packing=True ("bfd") under DeepSpeed's sp_size=2: each step's row holds two examples
    (position ids that restart at the second), which DeepSpeed's data path splits between the ranks without the
    sequence descriptors it cannot shard; each rank keeps the documents apart by the whole row's position ids,
    gathered. The losses and the weights after two steps are one process's on the same packed rows, whose documents
    it keeps apart (the one-process SFT tests check that against TRL's own); seen: 3.1 epsilons of each tensor's
    largest weight, both."""
    split = _trained(tmp_path, "split", rows)
    one = _trained(tmp_path, "one", rows, "--world-one", ranks=1)
    assert [grad for *_, grad in split["splits"]] == [True, True] and one["splits"] == []
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-12)
    assert _rounding(one["after"], split["after"]) < 8


@pytest.mark.parametrize("case", ["sft, split", "sft, unsplit", "dpo, split"])
def test_lora_under_zero3_trains_as_one_process(tmp_path, case):
    """A LoRA adapter (peft_config) under ZeRO-3, with and without the split (DPO's reference: the policy with its
    adapter disabled, split too, without grad): the losses and weights after two steps are one process's. ZeRO-3
    reduces a leaf layer's gradients in a backward hook that fires, for an input without grad (LoRA's frozen
    embeddings), before the layer's backward: the engine hands the layer an input that requires grad (seen: 0, 2.1
    and 1.6 epsilons of each tensor's largest weight)."""
    objective, how = case.split(", ")
    flags = ("--objective", objective, "--peft")
    split = _trained(tmp_path, "split", *flags, *(("--unsplit",) if how == "unsplit" else ()))
    one = _trained(tmp_path, "one", *flags, "--world-one", ranks=1)
    grads = (True,) * 2 if objective == "sft" else (True, False) * 2
    assert [grad for *_, grad in split["splits"]] == ([] if how == "unsplit" else list(grads))
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-12)
    assert any("lora_B" in n for n in one["after"]) and _rounding(one["after"], split["after"]) < 4


@pytest.mark.parametrize("launch", ["zero3_sp", "fsdp2_cp"])
def test_qlora_sft_under_the_split_trains_as_one_process(tmp_path, launch):
    """QLoRA as TRL builds it (NF4 base weights stored as float32 so that ZeRO-3 and FSDP2 shard them, LoRA from
    peft_config, which TRL casts to bfloat16) under DeepSpeed's sp_size=2 with ZeRO-3, or FSDP2's cp_size=2: two SFT
    steps log the losses of one process (to 1e-5: the bfloat16 adapters), its adapters after them to bfloat16
    rounding (seen: 1.6 and 0.8 bfloat16 epsilons of each tensor's largest weight), the base weights untouched."""
    flags = ("--peft", "--qlora")
    split = _trained(tmp_path, "split", *flags, *(("--cp",) if launch == "fsdp2_cp" else ()))
    one = _trained(tmp_path, "one", *flags, "--world-one", ranks=1)
    assert split["splits"] == [(0, 2, split["splits"][0][2], True)] * 2
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-5)
    adapters = [n for n in one["after"] if "lora" in n]
    assert adapters
    eps = torch.finfo(torch.bfloat16).eps
    worst = max(
        ((split["after"][n] - one["after"][n]).abs().max() / (eps * one["after"][n].abs().max())) for n in adapters
    )
    assert worst < 4
    # (the packed 4-bit weights read as float32 hold NaN patterns: compared with equal_nan)
    frozen = [n for n in one["after"] if n not in adapters]
    assert all(torch.allclose(split["after"][n], one["after"][n], rtol=0, atol=0, equal_nan=True) for n in frozen)


@pytest.mark.parametrize("objective", ["sft", "dpo", "reward"])
def test_evaluation_under_the_split_logs_one_processs_eval_loss(tmp_path, objective):
    """eval_strategy="steps" under the split: each rank evaluates rows of its own unsplit (the split is a training
    step's, whole-rows models' included; DeepSpeed's Ulysses attention is off in eval, accelerate's default), and the
    eval losses gathered over the ranks are one process's on the same rows (seen: 1e-7 relative, float32)."""
    split = _trained(tmp_path, "split", "--eval", "--objective", objective)
    one = _trained(tmp_path, "one", "--eval", "--objective", objective, "--world-one", ranks=1)
    assert [grad for *_, grad in split["splits"]] == list(SPLIT_CALLS[objective])  # (the training steps' alone)
    assert len(split["eval_losses"]) == len(one["eval_losses"]) == 2
    assert split["eval_losses"] == pytest.approx(one["eval_losses"], rel=1e-6)


def _logged(log: str) -> list[dict[str, str]]:
    """The Trainer's log lines ({'loss': ...}) in a command's output."""
    import ast

    return [ast.literal_eval(line[line.index("{'loss'") :]) for line in log.splitlines() if "{'loss'" in line]


@pytest.mark.parametrize(
    "command, launch",
    [("grpo", "zero3_sp"), ("distillation", "zero3_sp"), ("grpo", "fsdp2_cp"), ("distillation", "fsdp2_cp")],
)
def test_a_command_under_the_sequence_split_logs_one_processs_losses(tmp_path, command, launch):
    """``streambp-trl grpo|distillation --config configs/COMMAND_tiny.yaml`` launched as configs/accelerate/
    zero3_sp.yaml (DeepSpeed ZeRO-3 and its sequence parallelism) or fsdp2_cp.yaml (FSDP2 and context parallelism)
    launches it (the split in the environment accelerate hands each process; tests/sequence_split_cli.py does on two
    gloo processes what accelerate does on GPUs) logs the losses (and GRPO's
    rewards), completion lengths, entropies and token counts of the same command on one process, step for step: every
    rank generates from the group's first rank's random state, and the engine's split draws nothing from it (the
    distillation teacher streams the same share as its student)."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    steps = ("--max_steps", "2", "--logging_steps", "1")
    cp = ("--cp",) if launch == "fsdp2_cp" else ()
    torchrun("sequence_split_cli.py", *cp, command, str(tmp_path / "split"), *steps, log=tmp_path / "split.log")
    one = subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", command, "--config", f"configs/{command}_tiny.yaml", *steps]
        + ["--output_dir", str(tmp_path / "one")],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    split_log = (tmp_path / "split.log").read_text()
    assert "'stream_streamed': '1'" in split_log
    fields = ["loss", "completions/mean_length", "num_tokens", "entropy"] + (["reward"] if command == "grpo" else [])
    split, alone = _logged(split_log), _logged(one.stdout + one.stderr)
    assert len(split) == len(alone) == 2
    for ours, theirs in zip(split, alone, strict=True):
        assert {k: ours[k] for k in fields} == {k: theirs[k] for k in fields}
