"""``streambp-trl max-len``: size parsing, the search, the estimate table (memory model faked), and a real CPU
bisection against a small budget."""

import json
import math

import pytest

from streambp_trl import cli
from streambp_trl.bench import max_len as ml
from streambp_trl.bench import max_len_rows, plans
from streambp_trl.bench.measure import bisect_max_len
from streambp_trl.bench.models import build_config
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing import stream_step
from streambp_trl.sizing.choices import PlanChoices, StepPlan
from streambp_trl.sizing.layout import Layout
from streambp_trl.sizing.lengths import max_len
from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80G", 80 * 2**30),
        ("78GB", 78 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512mib", 512 * 2**20),
        ("1.5TiB", int(1.5 * 2**40)),
        ("64 KiB", 64 * 1024),
        ("4096", 4096),
        ("4096B", 4096),
    ],
)
def test_parse_size(text, expected):
    assert mm.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 GiBs", "-1GiB", "80XB", "eighty"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        mm.parse_size(text)


@pytest.mark.parametrize(
    ("peak", "budget", "limit", "expected"),
    [
        (lambda n: 100 + 0.01 * n, 400, 1 << 22, 29952),  # linear
        (lambda n: 100 + 1e-6 * n * n, 400, 1 << 22, 17152),  # quadratic
        (lambda n: 50 + 3 * math.sqrt(n), 400, 1 << 22, 13568),  # concave
        (lambda n: 100 + 0.01 * n, 1e9, 1 << 16, 1 << 16),  # everything fits: the limit
        (lambda n: 500 + 0.01 * n, 400, 1 << 22, 0),  # nothing fits
    ],
)
def test_search_finds_the_longest_fitting_multiple(peak, budget, limit, expected):
    step = 256
    calls = []

    def trial(n):
        calls.append(n)
        return peak(n)

    best, first_failure, trials = bisect_max_len(trial, step=step, budget=budget, limit=limit)
    assert best == expected and best % step == 0
    assert best == 0 or trials[best] <= budget
    if best == limit:
        assert first_failure is None
    else:
        assert first_failure == best + step and trials[first_failure] > budget
    assert len(calls) <= 14 and len(set(calls)) == len(calls)


def test_search_on_out_of_memory_only():
    """No budget: a length fits when it runs (the trial returns None when it runs out of memory)."""
    best, first_failure, _ = bisect_max_len(lambda n: None if n > 20000 else 1.0, step=1024, start=4096)
    assert (best, first_failure) == (19456, 20480)
    calls = []  # with a target (the GPU's memory), the measured peaks steer the search

    def trial(n):
        calls.append(n)
        return None if 100 + 0.01 * n > 290 else 100 + 0.01 * n

    best, first_failure, _ = bisect_max_len(trial, step=1024, target=300, start=4096)
    assert (best, first_failure) == (18432, 19456) and len(calls) <= 8


# --- the estimate path, with the memory model replaced by simple fakes --------------------------------------------

FAKE_PER_TOKEN = {"hf-gc": 2 * 2**20, "trl-default": 600 * 2**10, "stream": 300 * 2**10, "stream+offload": 40 * 2**10}
FAKE_BASE = 32 * 2**30


@pytest.fixture
def fake_model(monkeypatch):
    calls = {"shapes": [], "setups": []}
    shape = mm.ModelShape(
        layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936, params=8 * 10**9
    )

    def from_name(cls, name):
        calls["shapes"].append(name)
        return shape

    monkeypatch.setattr(plans, "host_room", lambda: 16 * 2**30)  # the plans' host memory: not this machine's now

    def peak(shape, setup, seq_len):
        calls["setups"].append(setup)
        return FAKE_BASE + FAKE_PER_TOKEN[setup.mode] * seq_len

    def host(shape, plan, n, db=2, rows=1):
        return 288 * 2**10 * n if plan.offload else 0

    def longest(shape, setup, budget_bytes, step=1024):
        return max(0, (budget_bytes - FAKE_BASE) // FAKE_PER_TOKEN[setup.mode] // step * step)

    def stream_row(shape, setup, budget, host_bytes, offload, keep_every=None, step=1024):
        calls["setups"].append(setup)
        calls["stream_rows"].append((setup.mode, host_bytes, offload, keep_every, step))
        n = longest(shape, setup, budget, step)
        plan = StepPlan(
            512, Layout(every=keep_every or 1), offload, FAKE_PER_TOKEN[setup.mode] * n, host(0, setup.plan(), n)
        )
        peak_bytes = peak(shape, setup, n)
        return {"max_len": n, "share": n, "plan": plan, "peak_bytes": peak_bytes, "host_bytes": plan.host or None}

    calls["stream_rows"] = []
    monkeypatch.setattr(mm.ModelShape, "from_name", classmethod(from_name))
    monkeypatch.setattr(mm, "estimate_peak_bytes", peak)
    monkeypatch.setattr(mm, "estimate_host_bytes", host)
    monkeypatch.setattr(ml, "max_len", longest)
    monkeypatch.setattr(ml, "stream_row", stream_row)
    return calls


def test_estimate_table(fake_model, capsys, tmp_path):
    out_file = tmp_path / "max_len.json"
    cli.main(["max-len", "--model", "qwen3-8b", "--gpu-memory", "80GiB", "--json", str(out_file)])
    out = capsys.readouterr().out
    assert "Estimated from the memory model" in out and "budget 80.00 GiB" in out and "Measured" not in out
    budget = 80 * 2**30
    rows, lengths = {}, {}
    for mode, (_, label) in ml.ROWS.items():
        length = (budget - FAKE_BASE) // FAKE_PER_TOKEN[mode] // 1024 * 1024
        line = next(line for line in out.splitlines() if line.startswith(f"| {label} |"))
        rows[mode], lengths[mode] = line, length
        assert f"| {length:,} |" in line
        assert f"| {(FAKE_BASE + FAKE_PER_TOKEN[mode] * length) / 2**30:.2f} |" in line
    assert rows["stream+offload"].endswith(f"| {288 * 2**10 * lengths['stream+offload'] / 2**30:.2f} |")
    assert rows["stream"].endswith("| - |")
    assert fake_model["shapes"] == ["qwen3-8b"]
    # the stream rows are the planner's, offload within the host memory the engine allows itself (faked: 16 GiB)
    assert fake_model["stream_rows"] == [
        ("stream", 16 * 2**30, False, None, 1024),
        ("stream+offload", 16 * 2**30, True, None, 1024),
    ]
    saved = json.loads(out_file.read_text())
    assert saved["kind"] == "estimated" and [r["mode"] for r in saved["rows"]] == list(ml.ROWS)


def test_estimate_passes_the_setup(fake_model, capsys):
    argv = ["max-len", "--model", "qwen3-4b", "--gpu-memory", "141GB", "--objective", "dpo", "--lora"]
    cli.main([*argv, "--chunk", "2048", "--optimizer", "adamw", "--mode", "trl-default", "stream"])
    out = capsys.readouterr().out
    assert "qwen3-4b, DPO (LoRA)" in out and "adamw" in out
    setups = {s.mode: s for s in fake_model["setups"]}
    assert set(setups) == {"trl-default", "stream"}
    for s in setups.values():
        # "adamw", max-len's earlier spelling, is TRL's default AdamW
        assert (s.objective, s.lora, s.optimizer, s.dtype_bytes) == ("dpo", True, "adamw_torch_fused", 2)
    assert (setups["stream"].chunk, setups["stream"].logits_chunk) == (2048, 2048)
    assert (setups["trl-default"].chunk, setups["trl-default"].logits_chunk) == (None, None)


def test_without_a_gpu_it_estimates_for_an_80gb_card(fake_model, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cli.main(["max-len", "--model", "8b"])
    out = capsys.readouterr().out
    assert "Estimated from the memory model" in out and "No GPU here: 78GiB" in out


@pytest.mark.parametrize("card, gib", [("h100", 78), ("a100-80gb", 78), ("a100-40gb", 38), ("h200", 139)])
def test_a_card_is_its_stated_memory_less_the_same_reserve(card, gib, fake_model, capsys, monkeypatch):
    """``--gpu-memory 141GB`` "for an H200" gave 131 GiB (decimal GB) where the 80 GB default is 78 GiB (80 GiB less
    the CUDA context): every card now takes the one rule, its stated size in GiB less 2 GiB."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a named card estimates even beside a GPU
    cli.main(["max-len", "--model", "qwen3-8b", "--gpu", card])
    out = capsys.readouterr().out
    assert f"budget {gib}.00 GiB" in out and f"({card}: {gib + 2} GiB less 2 GiB for the CUDA context.)" in out
    assert max_len_rows.gpu_budget(max_len_rows.DEFAULT_GPU) == max_len_rows.DEFAULT_GPU_MEMORY == "78GiB"
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-8b", "--gpu", card, "--gpu-memory", "70GiB"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_cpu_needs_a_budget(capsys):
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu"])
    assert "--budget" in capsys.readouterr().err


# --- a real bisection on the CPU ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_bisection_returns_a_length_that_fits_and_one_step_more_that_does_not(tmp_path, capsys, monkeypatch):
    """Every trial is one real forward+backward in a fresh process; its peak is the model plus peak RSS above it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # quicker on a busy machine; the measurement is per process
    out_file, step, budget = tmp_path / "cpu.json", 256, 40 * 2**20
    argv = ["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "40MiB", "--mode", "hf-gc"]
    cli.main([*argv, "--step", str(step), "--json", str(out_file)])
    out = capsys.readouterr().out
    assert "Measured on" in out and "(cpu), budget 40.00 MiB" in out
    result = json.loads(out_file.read_text())
    (row,) = result["rows"]
    length = row["max_len"]
    assert length >= step and length % step == 0 and row["first_failure"] == length + step
    trials = {p["seq_len"]: p for p in result["trials"]}
    assert trials[length]["status"] == "ok" and trials[length]["total_peak_mb"] * 2**20 <= budget
    assert trials[length + step]["status"] == "ok" and trials[length + step]["total_peak_mb"] * 2**20 > budget
    assert f"| {length:,} |" in out


# --- issue 16, item 15: sizes, rows of 0, Hub names, --offload, keep_every with offload, the progress label --------


@pytest.mark.parametrize(
    "argv", [["--gpu-memory", "80"], ["--device", "cpu", "--budget", "80"]], ids=["gpu-memory", "budget"]
)
def test_a_size_without_a_unit_is_refused(argv, fake_model, fake_measure, capsys):
    """``--gpu-memory 80`` was read as 80 bytes and every row was 0."""
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-8b", *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {argv[-2]}: '80' has no unit: write 80GiB (binary), 80GB (decimal) or 80MiB" in err
    with pytest.raises(ValueError, match="no unit"):
        mm.parse_size("80", unit_required=True)
    assert mm.parse_size("80GiB", unit_required=True) == 80 * 2**30 and mm.parse_size("80") == 80


def test_a_row_of_0_says_why(capsys):
    """The real memory model: Qwen3-32B's weights, gradients and AdamW state (TRL's default) alone exceed 78 GiB, which
    max-len says in one line with what fits instead; with LoRA at 15.9 GiB each mode's shortest length is over the
    budget."""
    cli.main(["max-len", "--model", "Qwen/Qwen3-32B", "--gpu-memory", "78GiB"])
    out = capsys.readouterr().out
    static = mm.static_bytes(mm.ModelShape.from_name("qwen3-32b"), mm.StepSetup(optimizer="adamw_torch_fused"))
    assert f"| {ml.ROWS['stream'][1]} | 0 |" in out
    (line,) = [line for line in out.splitlines() if line.startswith("Fits at no length")]
    assert line.startswith(
        f"Fits at no length: the weights, gradients and adamw_torch_fused state alone need {static / 2**30:.2f} GiB "
        "(32.76B parameters), above the budget of 78.00 GiB. Instead (the longest length streamed, with TRL's default "
        "in brackets): LoRA (--lora): "
    )
    argv = ["--gpu-memory", "15.9GiB", "--lora", "--mode", "stream", "--optim", "none"]
    cli.main(["max-len", "--model", "qwen3-8b", *argv])
    out = capsys.readouterr().out
    shape, setup = mm.ModelShape.from_name("qwen3-8b"), mm.StepSetup(lora=True, pending_grads=True)
    peak, static = plans.least_peak_bytes(shape, setup, 1024, False), mm.static_bytes(shape, mm.StepSetup(lora=True))
    # the least of any plan (some inputs rebuilt), below every input kept, above the budget less the planner's margin
    assert static < 15.9 * 2**30 - 254.4 * 2**20 < peak < mm.estimate_peak_bytes(shape, setup, 1024)
    assert (
        f"Fits at no length: 1,024 tokens need {peak / 2**30:.2f} GiB (the weights and gradients: "
        f"{static / 2**30:.2f} GiB), above the budget of 15.90 GiB less 254.40 MiB kept for fragmentation. Instead "
        "(the longest length streamed, with TRL's default in brackets): " in out
    )


@pytest.fixture
def no_hub(monkeypatch):
    """Any config lookup (the Hub, or a local directory) fails the test."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the config was looked up")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(plans, "host_room", lambda: 20 * 2**30)  # (the host memory available moves between calls)


@pytest.mark.parametrize(
    ("hub_name", "named"),
    [
        ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
        ("Qwen/Qwen3-8B", "qwen3-8b"),
        ("qwen/qwen3-8b-base", "qwen3-8b"),
        ("Qwen/Qwen3.5-9B", "qwen3.5-9b"),
        ("QWEN/QWEN3.5-27B", "qwen3.5-27b"),
    ],
)
def test_the_hub_name_of_a_named_shape_needs_no_network(hub_name, named, capsys, no_hub):
    """``Qwen/Qwen3-0.6B`` raised an OSError offline while ``qwen3-0.6b`` worked; ``Qwen/Qwen3.5-9B`` (a Hub
    checkpoint whose causal LM, as AutoModelForCausalLM builds it, is the named text decoder) still needed the network.
    Every spelling of a named shape's Hub name, in any case, prints the named shape's table without a lookup."""
    tables = []
    for name in (hub_name, named):
        cli.main(["max-len", "--model", name, "--lora", "--gpu-memory", "78GiB", "--mode", "trl-default", "stream"])
        tables.append(capsys.readouterr().out.split("\n", 1)[1])
    assert tables[0] == tables[1] and "| 0 |" not in tables[0]
    assert build_config(hub_name).num_hidden_layers == build_config(named).num_hidden_layers  # the measured path's


def test_our_test_shapes_are_not_hub_names():
    assert canonical_model_name("Qwen/qwen3-tiny") == "Qwen/qwen3-tiny"
    assert canonical_model_name("Qwen/Qwen3-8B-FP8") == "Qwen/Qwen3-8B-FP8"  # another storage: not the shape's
    assert canonical_model_name("someone/Qwen3-8B") == "someone/Qwen3-8B"


@pytest.mark.parametrize("name", ["qwen3-7b", "llama-8b", "./no/such/dir"])
def test_an_unknown_name_is_one_line_listing_the_named_shapes_without_asking_the_hub(name, no_hub):
    """``qwen3-7b`` (a typo) was reported as a network error: a name that is neither a named shape, a local
    directory nor a Hub id (org/name) is refused with the named shapes, and no config is looked up."""
    with pytest.raises(SystemExit) as info:
        cli.main(["max-len", "--model", name, "--gpu", "h100"])
    assert str(info.value) == (
        f"streambp-trl max-len: error: unknown model {name!r}; named shapes: {', '.join(NAMED_MODELS)} (or their "
        "Hub names, e.g. Qwen/Qwen3-8B), a local directory with a config.json, or a Hub id (org/name)."
    )


def test_an_unknown_hub_name_offline_is_one_line():
    """HF_HUB_OFFLINE=1 (tests/conftest.py): the config cannot be fetched."""
    with pytest.raises(SystemExit) as info:
        cli.main(["max-len", "--model", "nobody-here/unknown-model", "--gpu-memory", "78GiB"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "streambp-trl max-len: error: cannot read the config of --model 'nobody-here/unknown-model' ("
    )
    assert message.endswith(
        f"Give a local directory with its config.json, one of the named shapes: {', '.join(NAMED_MODELS)} (or their "
        "Hub names, e.g. Qwen/Qwen3-8B), or run with access to the Hub."
    )


def test_offload_in_an_estimate_says_it_changes_nothing(fake_model, capsys):
    base = ["max-len", "--model", "qwen3-8b", "--gpu-memory", "80GiB"]
    cli.main(base)
    plain = capsys.readouterr().out
    cli.main([*base, "--offload"])
    offload = capsys.readouterr().out
    note = "--offload changes nothing here: an estimate always has the stream + offload row."
    assert note not in plain and offload == f"{plain}\n{note}\n"
    cli.main([*base, "--mode", "stream", "--offload"])  # with --mode, --offload adds the row
    assert f"| {ml.ROWS['stream+offload'][1]} |" in capsys.readouterr().out


@pytest.mark.parametrize("k", [2, 6])
def test_keep_every_with_offload_says_why_it_fits_less(k, capsys, monkeypatch):
    """With host memory to spare (1 TiB), offload keeping every k-th input fits less than keeping every input: the
    note says why. Within 16 GiB of host memory keeping every input fits less, and the note is not printed."""
    monkeypatch.setattr(plans, "host_room", lambda: 2**40)
    shape, budget = mm.ModelShape.from_name("qwen3-8b"), 78 * 2**30
    one, every_k = (mm.StepSetup(mode="stream+offload", keep_every=j) for j in (1, k))
    assert max_len(shape, every_k, budget) < max_len(shape, one, budget)
    assert mm.estimate_host_bytes(shape, every_k.plan(), 2**20) < mm.estimate_host_bytes(shape, one.plan(), 2**20)
    assert (
        stream_step._saved_inputs(shape.layers, Layout(every=k), True),
        stream_step._saved_inputs(shape.layers, Layout(), True),
    ) == (
        k + 1,
        2,
    )
    argv = ["max-len", "--model", "qwen3-8b", "--gpu-memory", "78GiB", "--keep-every", str(k)]
    cli.main(argv)
    note = (
        f"With offload, keep_every={k} fits less than offload alone: a segment's backward holds its {k} layer "
        f"inputs (the kept one and {k - 1} rebuilt) and the prefetched input of the segment below, {k + 1} on the "
        f"GPU against 2; what it saves is host memory (about 1/{k})."
    )
    out = capsys.readouterr().out
    assert note in out.splitlines()
    (row,) = [line for line in out.splitlines() if line.startswith(f"| {ml.ROWS['stream+offload'][1]}, ")]
    assert row.startswith(f"| {ml.ROWS['stream+offload'][1]}, keep_every={k} |")  # the label says so
    cli.main([*argv, "--host-memory", "16GiB"])
    assert "With offload" not in capsys.readouterr().out


@pytest.fixture
def fake_measure(monkeypatch):
    """Measured runs without processes: 10 MiB plus 40 KiB per token."""

    def measure(spec, timeout=None, log=True):
        n = spec.seq_len
        return {"status": "ok", "seq_len": n, "total_peak_mb": 10 + n * 40 / 1024, "time_s": 0.1, "mode": spec.mode}

    monkeypatch.setattr(ml, "measure", measure)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


def test_measured_progress_labels_are_whole_and_offload_adds_its_row(fake_measure, capsys):
    cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "20MiB", "--step", "64"])
    captured = capsys.readouterr()
    assert ml.ROWS["trl-default"][1] + ":" in captured.err  # was cut to 34 characters
    assert f"| {ml.ROWS['trl-default'][1]} | 256 |" in captured.out and "offload" not in captured.out
    cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "20MiB", "--mode", "stream"])
    assert "offload" not in capsys.readouterr().out
    cli.main(
        ["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "20MiB", "--mode", "stream", "--offload"]
    )
    assert f"| {ml.ROWS['stream+offload'][1]}" in capsys.readouterr().out


def test_a_measured_row_of_0_says_why(fake_measure, capsys):
    cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "12MiB", "--step", "256"])
    out = capsys.readouterr().out
    assert "0 for every mode: 256 tokens already peak at 20.00 MiB, above the --budget of 12.00 MiB." in out


def test_an_estimate_shows_what_auto_would_plan_from_the_engines_planner(capsys, monkeypatch):
    """An estimate lists, per length, the plan the engine's own planner takes for a model of that shape within the
    same budget (its chunk, kept inputs, offload, predicted peak and pinned host memory): Qwen3-8B, chunk 2048, 78 GiB,
    20 GiB of host memory to pin, the parameter gradients formed by the backward (the default, as a trainer's steps
    with gradient_accumulation_steps=1 run). At 212,992 tokens one input is rebuilt (every input kept is over the
    budget less the 1 GiB margin) and that is what AutoChunks plans for a Qwen3-8B built on the meta device, which
    holds no gradient."""
    import torch
    import transformers

    from streambp_trl.sizing import auto

    monkeypatch.setattr(auto, "host_room", lambda: 20 * 2**30)
    monkeypatch.setattr(plans, "host_room", lambda: 20 * 2**30)
    argv = ["--model", "qwen3-8b", "--gpu-memory", "78GiB", "--chunk", "2048", "--optimizer", "none"]
    result = ml.main([*argv, "--lengths", "131072", "212992", "262144"])
    out = capsys.readouterr().out
    assert "| 212,992 | chunk 2048, 1 layer input rebuilt in backward | 76.8 GiB | - |" in out
    assert "| 131,072 | chunk 2048, every layer input kept, keys/values kept from the forward |" in out
    rows = {row["tokens"]: row for row in result["plans"]["rows"]}
    config = transformers.Qwen3Config(
        num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    planner = auto.AutoChunks(model, PlanChoices(chunk=2048, budget=78 * 2**30))
    for tokens, row in rows.items():
        plan = planner.plan(1, tokens, torch.device("meta"))
        assert (plan.chunk, plan.layout.every, plan.layout.drop, plan.offload, plan.kv_mode == "capture") == (
            row["chunk"], row["layout"]["every"], row["layout"]["drop"], row["offload"], row["capture"]
        ), tokens  # fmt: skip


def test_the_offload_row_pins_at_most_the_host_memory_given_or_the_engines_own(monkeypatch, capsys):
    """The offload row ignored --host-memory (200GiB: still 1,474,560 tokens with 393.75 GiB of host memory) and by
    default assumed 394-499 GiB of pinned host memory. It now pins at most --host-memory, by default what the engine
    allows itself (:func:`streambp_trl.sizing.room.host_room`, here faked: 16 GiB), and says which."""
    from streambp_trl.sizing import auto, room

    assert plans.host_room is room.host_room is auto.host_room  # the engine's own rule
    monkeypatch.setattr(plans, "host_room", lambda: 16 * 2**30)
    argv = ["--model", "Qwen/Qwen3-8B", "--lora", "--objective", "dpo", "--gpu", "h100"]
    said = {
        16: "offload pins at most 16.00 GiB of host memory: three quarters of this machine's available memory, as the "
        "engine allows itself (--host-memory for another machine's).",
        200: "offload pins at most 200.00 GiB of host memory (--host-memory).",
    }
    lengths = []
    for gib, extra in ((16, []), (200, ["--host-memory", "200GiB"])):
        result = ml.main([*argv, *extra])
        out = capsys.readouterr().out
        (row,) = [row for row in result["rows"] if row["mode"] == "stream+offload"]
        assert said[gib] in out and result["plans"]["host_bytes"] == gib * 2**30
        assert 0 < row["host_bytes"] <= gib * 2**30
        assert f"| {row['max_len']:,} | {row['peak_bytes'] / 2**30:.2f} | {row['host_bytes'] / 2**30:.2f} |" in out
        lengths.append(row["max_len"])
        stream = next(row["max_len"] for row in result["rows"] if row["mode"] == "stream")
        no_further = "Offload reaches no further than the stream row within 16.00 GiB of host memory (--host-memory "
        assert (no_further in out) == (row["max_len"] <= stream) == (gib == 16)
    assert lengths[0] < lengths[1]


def test_an_estimates_stream_lengths_are_multiples_of_the_step(monkeypatch, capsys):
    """--step: the stream rows, the plans and their footer name multiples of it, as the other rows do."""
    monkeypatch.setattr(plans, "host_room", lambda: 16 * 2**30)
    result = ml.main(["--model", "qwen3-8b", "--lora", "--gpu", "h100", "--step", "4096"])
    capsys.readouterr()
    lengths = [row["max_len"] for row in result["rows"]] + list(result["plans"]["longest"].values())
    assert all(n > 0 and n % 4096 == 0 for n in lengths), lengths
