"""``scripts/gpu.py bench``: its time-budget decisions, summary and bracket (pure functions), its order of
measurements with a fake measure and clock, and a real run on the CPU (the fallback CI runs)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streambp_trl.bench.spec import MeasureSpec, Mode
from streambp_trl.sizing.shapes import NAMED_MODELS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu.py"
# appended, not first: scripts/model_support.py must not shadow tests/model_support.py
sys.path.append(str(SCRIPT.parent))
from subcommands import gpu_bench as gb  # noqa: E402


def _rec(mode, n, time_s=1.0, wall_s=None, status="ok", peak_mb=10.0, warmup_seq_len=None, **extra):
    record = {"mode": str(mode), "seq_len": n, "status": status, "batch_size": 1, "wall_s": wall_s, **extra}
    if status == "ok":
        record.update(time_s=time_s, peak_mb=peak_mb, total_peak_mb=peak_mb + 100)
    if warmup_seq_len is not None:
        record["warmup_seq_len"] = warmup_seq_len
    return record


def test_device_slug():
    assert gb.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert gb.device_slug("  NVIDIA H200 (141 GB) ") == "nvidia_h200_141_gb"


def test_predict_wall_s_scales_the_full_length_steps():
    assert gb.predict_wall_s([], Mode.STREAM, 1000, None) is None
    # only an oom so far: its wall time
    assert gb.predict_wall_s([_rec(Mode.CHECKPOINT, 1000, status="oom", wall_s=7.0)], Mode.STREAM, 2000, 100) == 7.0
    # one length, warm-up short: 8 s fixed, the 2 s step scaled by (2000/1000)**2
    one = [_rec(Mode.STREAM, 1000, time_s=2.0, wall_s=10.0, warmup_seq_len=100)]
    assert gb.predict_wall_s(one, Mode.STREAM, 2000, 100) == pytest.approx(8 + 2 * 4)
    assert gb.predict_wall_s(one, Mode.STREAM, 2000, None) == pytest.approx(8 + 2 * 2 * 4)  # full-length warm-up
    assert gb.predict_wall_s(one, Mode.STREAM_OFFLOAD, 2000, 100) == pytest.approx(16)  # another mode's record
    # a full-length warm-up in the reference: two steps of its wall time were full length
    full = [_rec(Mode.STREAM, 1000, time_s=2.0, wall_s=10.0)]
    assert gb.predict_wall_s(full, Mode.STREAM, 1000, None) == pytest.approx(10)
    # two lengths: time doubles with the length, exponent 1, from the longest length at or below
    two = [*one, _rec(Mode.STREAM, 2000, time_s=4.0, wall_s=13.0, warmup_seq_len=100)]
    assert gb.predict_wall_s(two, Mode.STREAM, 4000, 100) == pytest.approx(9 + 4 * 2)
    assert gb.predict_wall_s(two, Mode.STREAM, 1500, 100) == pytest.approx(8 + 2 * 1.5)
    assert gb.predict_wall_s(two, Mode.STREAM, 500, 100) == pytest.approx(8 + 2 * 0.5)  # below every length
    # two measured steps per process (--repeats 2): both scale, the fixed part is what is left of the wall time
    twice = [_rec(Mode.STREAM, 1000, time_s=2.0, wall_s=10.0, warmup_seq_len=100, repeats=2)]
    assert gb.predict_wall_s(twice, Mode.STREAM, 2000, 100) == pytest.approx(6 + 2 * 2 * 4)
    # the exponent stays within [1, 2]
    steep = [*one, _rec(Mode.STREAM, 2000, time_s=16.0, wall_s=24.0, warmup_seq_len=100)]
    assert gb.predict_wall_s(steep, Mode.STREAM, 4000, 100) == pytest.approx(8 + 16 * 4)


@pytest.mark.parametrize(
    ("elapsed", "predicted", "expected"),
    [
        (100, None, None),
        (100, 400, None),
        (100, 441, "would likely pass the time budget (about 441 s needed, 440 s left)"),
        (540, None, "time budget spent (540 s of 540 s)"),
        (600, 1, "time budget spent (600 s of 540 s)"),
    ],
)
def test_skip_reason(elapsed, predicted, expected):
    assert gb.skip_reason(elapsed, 540, predicted) == expected


def test_summary_ratios_and_memory_per_token():
    records = [
        _rec(Mode.CHECKPOINT, 1024, time_s=1.0, peak_mb=100),
        _rec(Mode.CHECKPOINT, 2048, status="oom"),
        _rec(Mode.CHECKPOINT_CHUNKED_LOSS, 1024, time_s=1.25, peak_mb=50),
        _rec(Mode.CHECKPOINT_CHUNKED_LOSS, 2048, time_s=2.5, peak_mb=90),
        _rec(Mode.STREAM, 1024, time_s=1.2, peak_mb=20),
        _rec(Mode.STREAM, 2048, time_s=2.0, peak_mb=30),
        _rec(Mode.STREAM_OFFLOAD, 1024, time_s=1.32, peak_mb=18),
        _rec(Mode.STREAM_OFFLOAD, 2048, time_s=2.4, peak_mb=22),
    ]
    s = gb.summarize(records)
    assert s["stream_vs_checkpoint_time"] == {"1024": {"ratio": pytest.approx(1.2)}}  # checkpoint ran out at 2048
    assert s["stream_vs_trl_default_time"]["1024"]["ratio"] == pytest.approx(0.96)
    assert s["stream_vs_trl_default_time"]["2048"]["ratio"] == pytest.approx(0.8)
    offload = s["offload_vs_stream_time"]
    assert offload["1024"] == {"ratio": pytest.approx(1.1), "target": 1.15, "met": True}
    assert offload["2048"] == {"ratio": pytest.approx(1.2), "target": 1.15, "met": False}
    per_token = s["memory_per_extra_token"]
    assert set(per_token) == {"checkpoint+chunked-loss", "stream", "stream+offload"}  # checkpoint: one length ok
    assert per_token["stream"]["kib_per_token"] == pytest.approx(10 * 1024 / 1024)
    assert per_token["checkpoint+chunked-loss"]["kib_per_token"] == pytest.approx(40.0)


def test_bracket():
    budget = 200 * 2**20  # total_peak_mb = peak_mb + 100
    trials = [
        _rec(Mode.STREAM, 4096, peak_mb=50),
        _rec(Mode.STREAM, 8192, peak_mb=99),
        _rec(Mode.STREAM, 16384, status="oom"),
        _rec(Mode.STREAM, 12288, peak_mb=101),  # ran, above the budget
        _rec(Mode.STREAM, 10240, status="error"),  # timed out: neither
    ]
    assert gb.bracket(trials, budget) == (8192, 12288)
    assert gb.bracket(trials[:2], budget) == (8192, None)
    assert gb.bracket(trials[2:], budget) == (0, 12288)
    assert gb.bracket([], budget) == (0, None)


def test_repeats_report_the_fastest_step(tmp_path, monkeypatch):
    """Each process measures ``--repeats`` steps; the record's time is the fastest (what later steps of a training
    run take), the first kept as ``first_step_s`` (it also allocates pinned host buffers and cuDNN plans)."""
    specs = []

    def fake_measure(spec, timeout=None, log=True):
        specs.append(spec)
        record = {"mode": str(spec.mode), "seq_len": spec.seq_len, "batch_size": 1, "status": "ok"}
        return {**record, "time_s": 1.5, "time_min_s": 1.0, "times_s": [2.0, 1.0], "peak_mb": 1, "total_peak_mb": 11}

    monkeypatch.setattr(gb, "measure", fake_measure)
    argv = ["--device", "cpu", "--model", "qwen3-tiny", "--mode", "stream", "--seq-len", "256", "--chunk", "128"]
    result = gb.main([*argv, "--no-max-len", "--out-dir", str(tmp_path)])
    assert {s.repeats for s in specs} == {2} and result["settings"]["repeats"] == 2
    record = result["records"][0]
    assert (record["time_s"], record["first_step_s"]) == (1.0, 2.0)
    assert record["ms_per_1k_tokens"] == pytest.approx(1e6 * 1.0 / 256)


def test_planned_runs_as_the_trainers_plan_within_the_cap(tmp_path, monkeypatch):
    """``--planned --memory-cap``: each spec leaves chunk, tile and kept keys/values to the plan within the cap (the
    bisection's budget too); ``--kv-mode`` still fixes the keys/values; the report says how stream ran; the memory
    model's estimate sizes the plan that ran, and none for a plan that rebuilt inputs."""
    specs = []

    def fake_measure(spec, timeout=None, log=True):
        specs.append(spec)
        record = {"mode": str(spec.mode), "seq_len": spec.seq_len, "batch_size": 1, "status": "ok", "time_s": 1.0}
        record.update(peak_mb=1, total_peak_mb=11, stream_chunk_size=128, logits_chunk_size=64, captured=True)
        return {**record, "inputs_rebuilt": 1 if spec.seq_len == 512 else 0, "offloaded": False}

    monkeypatch.setattr(gb, "measure", fake_measure)
    argv = ["--device", "cpu", "--model", "qwen3-8b", "--mode", "stream", "--seq-len", "256", "512", "--planned"]
    result = gb.main([*argv, "--memory-cap", "2GiB", "--no-max-len", "--out-dir", str(tmp_path)])
    assert all(s.planned and s.kv_mode is None and s.stream_chunk_size == "auto" for s in specs)
    assert {(s.memory_budget, s.memory_cap) for s in specs} == {("2GiB", "2GiB")}
    assert result["settings"]["kv_mode"] == "planned" and "stream as the trainers plan it" in gb.render_markdown(
        result
    )
    at_256, at_512 = result["records"]
    assert at_256["estimated_peak_mb"] == gb.estimated_peak_mb(
        "qwen3-8b", Mode.STREAM, 256, "float32", 128, None, True, 64
    )
    assert "estimated_peak_mb" not in at_512  # (the memory model's estimate keeps every input)
    assert gb.build_parser().parse_args(["--memory-cap", "2GiB"]).memory_cap == "2GiB"
    with pytest.raises(SystemExit):
        gb.main([*argv, "--memory-cap", "2", "--no-max-len", "--out-dir", str(tmp_path)])  # a size without its unit
    specs.clear()
    gb.main([*argv, "--kv-mode", "recompute", "--no-max-len", "--out-dir", str(tmp_path)])
    assert {s.kv_mode for s in specs} == {"recompute"}


def test_order_oom_and_time_budget_with_a_fake_measure(tmp_path, monkeypatch):
    """Lengths increasing, modes interleaved; a mode that ran out of memory is not run longer; nothing starts that
    would likely pass the time budget; the bisection stops with the grid's bracket."""
    now = [0.0]
    calls = []

    def fake_measure(spec, timeout=None, log=True):
        assert isinstance(spec, MeasureSpec) and spec.warmup_seq_len == 128
        assert timeout == pytest.approx(110 - now[0])
        calls.append((str(spec.mode), spec.seq_len))
        wall = 10 * spec.seq_len / 256
        now[0] += wall
        record = {"mode": str(spec.mode), "seq_len": spec.seq_len, "batch_size": 1, "warmup_seq_len": 128}
        if spec.mode is Mode.CHECKPOINT and spec.seq_len >= 512:
            return {**record, "status": "oom", "error": "OutOfMemoryError"}
        peak = spec.seq_len / 100
        return {**record, "status": "ok", "time_s": wall / 2, "peak_mb": peak, "total_peak_mb": 10 + peak}

    monkeypatch.setattr(gb, "measure", fake_measure)
    monkeypatch.setattr(gb.Run, "clock", staticmethod(lambda: now[0]))
    argv = ["--device", "cpu", "--model", "qwen3-tiny", "--mode", "checkpoint", "stream", "stream+offload"]
    argv += ["--seq-len", "1024", "256", "512", "--chunk", "128", "--step", "256", "--warmup-seq-len", "128"]
    argv += ["--repeats", "1"]  # the fake's wall time holds one measured step
    result = gb.main([*argv, "--budget", "1GiB", "--time-budget", "110", "--out-dir", str(tmp_path)])
    # 256: 3 x 10 s; 512: 3 x 20 s (checkpoint out of memory); 1024: about 30 s predicted with 20 s left
    assert calls == [(m, n) for n in (256, 512) for m in ("checkpoint", "stream", "stream+offload")]
    skipped = {(k["mode"], k.get("seq_len")): k["reason"] for k in result["skipped"]}
    assert skipped[("checkpoint", 1024)] == "oom at a shorter length (512)"
    for mode in ("stream", "stream+offload"):
        assert skipped[(mode, 1024)] == "would likely pass the time budget (about 30 s needed, 20 s left)"
    section = result["max_len"]
    assert section["status"].startswith("stopped by time budget before")
    assert (section["longest_fit"], section["shortest_failure"]) == (512, None)
    assert section["total_peak_mb_at_longest_fit"] == pytest.approx(10 + 5.12)
    assert skipped[("stream", None)] == section["status"]
    saved = json.loads((tmp_path / "cpu_fallback.json").read_text())
    assert saved["command"].startswith("python ") and saved["command"].endswith("--out-dir " + str(tmp_path))
    assert [(r["mode"], r["seq_len"]) for r in saved["records"]] == calls
    assert saved["records"][1]["estimated_peak_mb"] > 0 and saved["records"][1]["ms_per_1k_tokens"] > 0
    md = (tmp_path / "cpu_fallback.md").read_text()
    assert "- checkpoint at 1024: oom at a shorter length (512)" in md and "**512** tokens" in md


@pytest.mark.slow
def test_cpu_run(tmp_path):
    """The CPU fallback, for real: every measurement a fresh process (warm-up at 128 tokens), then a short bisection
    against 24 MiB."""
    cmd = [sys.executable, str(SCRIPT), "bench", "--device", "cpu", "--model", "qwen3-tiny", "--seq-len", "256", "512"]
    cmd += ["--mode", "checkpoint+chunked-loss", "stream", "stream+offload", "--chunk", "128", "--step", "256"]
    # (a time budget a loaded machine does not spend: with two other test suites running beside it, 120 s cut these
    # measurements short)
    cmd += ["--warmup-seq-len", "128", "--budget", "24MiB", "--out-dir", str(tmp_path), "--time-budget", "400"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # quicker on a busy machine
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "cpu_fallback.json").read_text())
    status = {(r["mode"], r["seq_len"]): r["status"] for r in result["records"]}
    assert status == {
        (m, n): "ok" for m in ("checkpoint+chunked-loss", "stream", "stream+offload") for n in (256, 512)
    }
    assert all(r["warmup_seq_len"] == 128 for r in result["records"])
    assert result["command"].startswith("python ") and "gpu.py bench" in result["command"]
    assert result["env"]["device"] == "cpu" and result["env"]["versions"]["torch"]
    offload = result["summary"]["offload_vs_stream_time"]
    assert set(offload) == {"256", "512"} and all(math.isfinite(v["ratio"]) for v in offload.values())
    section = result["max_len"]
    assert section["longest_fit"] > 0 and section["longest_fit"] % 256 == 0
    assert section["total_peak_mb_at_longest_fit"] * 2**20 <= 24 * 2**20, section
    md = (tmp_path / "cpu_fallback.md").read_text()
    assert "| stream |" in md and "Stream's longest length" in md and md in proc.stdout


def test_the_worker_records_the_logit_form_it_ran_and_its_budget():
    """A stream measurement says which gradient form the logit kernel took (a budget given, or the free memory):
    the memory model's estimate depends on it (the eager form holds a (rows x hidden) accumulator more)."""
    from streambp_trl.bench.spec import MeasureSpec
    from streambp_trl.bench.worker import run_worker
    from streambp_trl.sizing.memory_model import HEAD_FORMS

    spec = dict(mode="stream", seq_len=64, model="qwen3-tiny", device="cpu", dtype="float32", stream_chunk_size=32)
    record = run_worker(MeasureSpec(**spec, memory_budget="1GiB"))
    assert record["status"] == "ok" and record["head_form"] in HEAD_FORMS and record["memory_budget"] == "1GiB"
    assert "head_form" not in run_worker(MeasureSpec(**{**spec, "mode": "checkpoint"}))


def test_the_worker_records_the_plan_auto_chose():
    """A planned stream measurement (kept inputs and offload left to the plan, as the trainers leave them) records
    the plan in words; with every choice fixed the plan only checks the budget, and runs the choices as fixed."""
    from streambp_trl.bench.worker import run_worker

    spec = dict(mode="stream", seq_len=64, model="qwen3-tiny", device="cpu", dtype="float32", stream_chunk_size=32)
    record = run_worker(MeasureSpec(**spec, memory_budget="1GiB", planned=True))
    every_kept = "every layer's activations kept from the forward (nothing recomputed)"
    assert record["plan"] == f"64 tokens: chunk 32, {every_kept}"
    assert (record["kv_mode"], record["inputs_rebuilt"], record["offloaded"], record["layers_kept"]) == (
        "planned",
        0,
        False,
        2,
    )
    fixed = run_worker(MeasureSpec(**spec, memory_budget="1GiB"))  # chunk, kept inputs, offload fixed
    assert fixed["plan"] == "64 tokens: chunk 32, every layer input kept"
    assert (fixed["kv_mode"], fixed["captured"], fixed["layers_kept"]) == ("recompute", False, 0)


@pytest.mark.parametrize(
    ("mode", "planned", "kv_mode", "expected"),
    [
        ("stream", False, None, ("recompute", False, 1)),
        ("stream", True, None, (None, None, None)),
        ("stream", True, "recompute", ("recompute", None, None)),
        ("stream+offload", True, None, (None, True, None)),
        ("stream+offload", False, "capture", ("capture", True, 1)),
    ],
)
def test_stream_options_fix_what_is_given_and_plan_the_rest(mode, planned, kv_mode, expected):
    """A spec's kv_mode None is recompute unless planned; planned leaves kept inputs and offload to the plan, except
    that stream+offload fixes offload on."""
    from streambp_trl.bench.models import _stream_options

    spec = MeasureSpec(mode=mode, seq_len=8, model="qwen3-tiny", device="cpu", dtype="float32", planned=planned,
                       kv_mode=kv_mode)  # fmt: skip
    options = _stream_options(spec)
    assert (options["kv_mode"], options["offload_checkpoints"], options["keep_every"]) == expected


@pytest.mark.slow
def test_long_context_kit_on_the_cpu(tmp_path):
    """scripts/gpu.py long-context end to end on a tiny model: TRL's default, "auto" at two lengths and the
    StreamSFTTrainer LoRA run, each in a fresh process, written as JSON lines and a table with the plans."""
    cmd = [sys.executable, str(SCRIPT), "long-context", "--device", "cpu", "--model", "qwen3-tiny"]
    cmd += ["--dtype", "float32"]
    cmd += [
        "--lengths",
        "256",
        "512",
        "--trainer-length",
        "128",
        "--cap",
        "none",
        "--budget",
        "1GiB",
        "--warmup",
        "64",
    ]
    cmd += ["--out-dir", str(tmp_path), "--name", "lc"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "lc.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["seq_len"]) for r in records] == [
        ("checkpoint+chunked-loss", 256), ("stream auto", 256), ("stream auto", 512), ("StreamSFTTrainer+LoRA", 128)
    ]  # fmt: skip
    assert all(r.get("status", "ok") == "ok" for r in records), records
    assert records[2]["plan"].startswith("512 tokens: chunk 512") and len(records[3]["losses"]) == 2
    assert "| stream auto | 512 | ok |" in (tmp_path / "lc.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("trl_default", [True, False], ids=["trl_default", "stream"])
def test_qlora_kit_on_the_cpu(tmp_path, trl_default):
    """The kit's QLoRA runs (gpu_session.sh qlora) on a tiny model: no stream-only run, the trainer on NF4 base weights
    (every decoder linear map a bitsandbytes 4-bit layer), one optimizer step."""
    pytest.importorskip("bitsandbytes")
    cmd = [sys.executable, str(SCRIPT), "long-context", "--device", "cpu", "--model", "qwen3-tiny", "--no-baseline"]
    cmd += ["--lengths"]
    cmd += ["--quantize", "--trainer-steps", "1", "--trainer-length", "128", "--cap", "none", "--budget", "1GiB"]
    cmd += ["--out-dir", str(tmp_path), "--name", "q", *(["--trl-trainer"] if trl_default else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    trainer = "SFTTrainer (TRL's default)" if trl_default else "StreamSFTTrainer"
    assert record["mode"] == f"{trainer}+QLoRA (NF4)" and record.get("status", "ok") == "ok", record
    layers = NAMED_MODELS["qwen3-tiny"]["num_hidden_layers"]
    assert record["4bit_layers"] == 7 * layers and len(record["losses"]) == 1
    assert (record["plan"] is None) == trl_default
