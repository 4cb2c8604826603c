"""``streambp-trl max-len``: size parsing, the search, the estimate table (memory model faked), and a real CPU
bisection against a small budget."""

import json
import math

import pytest

from streambp_trl import cli
from streambp_trl.sizing import max_len as ml
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.measure import bisect_max_len


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
    assert ml.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 GiBs", "-1GiB", "80XB", "eighty"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        ml.parse_size(text)


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

    def probe(n):
        calls.append(n)
        return peak(n)

    best, first_failure, probes = bisect_max_len(probe, step=step, budget=budget, limit=limit)
    assert best == expected and best % step == 0
    assert best == 0 or probes[best] <= budget
    if best == limit:
        assert first_failure is None
    else:
        assert first_failure == best + step and probes[first_failure] > budget
    assert len(calls) <= 14 and len(set(calls)) == len(calls)


def test_search_on_out_of_memory_only():
    """No budget: a length fits when it runs (the probe returns None when it runs out of memory)."""
    best, first_failure, _ = bisect_max_len(lambda n: None if n > 20000 else 1.0, step=1024, start=4096)
    assert (best, first_failure) == (19456, 20480)
    calls = []  # with a target (the GPU's memory), the measured peaks steer the search

    def probe(n):
        calls.append(n)
        return None if 100 + 0.01 * n > 290 else 100 + 0.01 * n

    best, first_failure, _ = bisect_max_len(probe, step=1024, target=300, start=4096)
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

    def peak(shape, setup, seq_len):
        calls["setups"].append(setup)
        return FAKE_BASE + FAKE_PER_TOKEN[setup.mode] * seq_len

    def host(shape, setup, seq_len):
        return 288 * 2**10 * seq_len if setup.mode == "stream+offload" else 0

    def longest(shape, setup, budget_bytes, step=1024):
        return max(0, (budget_bytes - FAKE_BASE) // FAKE_PER_TOKEN[setup.mode] // step * step)

    monkeypatch.setattr(mm.ModelShape, "from_name", classmethod(from_name))
    monkeypatch.setattr(mm, "estimate_peak_bytes", peak)
    monkeypatch.setattr(mm, "estimate_host_bytes", host)
    monkeypatch.setattr(mm, "max_len", longest)
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
        assert (s.objective, s.lora, s.optimizer_bytes_per_param, s.dtype_bytes) == ("dpo", True, 8, 2)
    assert (setups["stream"].chunk, setups["stream"].logits_chunk) == (2048, 2048)
    assert (setups["trl-default"].chunk, setups["trl-default"].logits_chunk) == (None, None)


def test_without_a_gpu_it_estimates_for_an_80gb_card(fake_model, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cli.main(["max-len", "--model", "8b"])
    out = capsys.readouterr().out
    assert "Estimated from the memory model" in out and "No GPU here: 78GiB" in out


def test_cpu_needs_a_budget(capsys):
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu"])
    assert "--budget" in capsys.readouterr().err


# --- a real bisection on the CPU ----------------------------------------------------------------------------------


def test_cpu_bisection_returns_a_length_that_fits_and_one_step_more_that_does_not(tmp_path, capsys, monkeypatch):
    """Every probe is one real forward+backward in a fresh process; its peak is the model plus peak RSS above it."""
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
    probes = {p["seq_len"]: p for p in result["probes"]}
    assert probes[length]["status"] == "ok" and probes[length]["total_peak_mb"] * 2**20 <= budget
    assert probes[length + step]["status"] == "ok" and probes[length + step]["total_peak_mb"] * 2**20 > budget
    assert f"| {length:,} |" in out
