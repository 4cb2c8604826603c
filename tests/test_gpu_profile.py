"""scripts/gpu.py profile (where a step's GPU time goes) on the CPU: its configurations, the trace analysis on a
made-up chrome trace (kernel time by kind and by engine phase, busy share, launches and syncs), and one end-to-end
run of two configurations in fresh processes."""

import json
import sys
from pathlib import Path

import pytest

# appended, not first: scripts/model_support.py must not shadow tests/model_support.py
sys.path.append(str(Path(__file__).resolve().parents[1] / "scripts"))
from subcommands import gpu_profile  # noqa: E402

from streambp_trl.bench.spec import Mode  # noqa: E402


def test_configurations():
    assert gpu_profile.parse_config("trl") == {"mode": Mode.CHECKPOINT_CHUNKED_LOSS}
    assert gpu_profile.parse_config("stream+offload:4096:capture") == {
        "mode": Mode.STREAM_OFFLOAD,
        "stream_chunk_size": 4096,
        "logits_chunk_size": 4096,
        "kv_mode": "capture",
    }
    with pytest.raises(Exception, match="unknown mode"):
        gpu_profile.parse_config("fast:4096")


def _event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_trace_analysis():
    """Kernels are attributed to the innermost ``sbp/`` span open on their launching thread, launched through the
    runtime or the driver API (cuBLAS's and cuDNN's kernels); launches and syncs are counted inside the step only; the
    busy time is the union of kernel intervals."""
    events = [
        _event("user_annotation", "profiled_step", 0, 100),
        _event("user_annotation", "sbp/layer_backward", 10, 60, tid=2),
        _event("user_annotation", "sbp/chunk_backwards", 20, 30, tid=2),
        _event("cuda_runtime", "cudaLaunchKernel", 25, 1, tid=2, correlation=1),  # chunk_backwards
        _event("cuda_driver", "cuLaunchKernelEx", 60, 1, tid=2, correlation=2),  # layer_backward (cuDNN's launch)
        _event("cuda_runtime", "cudaLaunchKernel", 25, 1, tid=3, correlation=3),  # another thread: outside
        _event("cuda_runtime", "cudaStreamSynchronize", 90, 2, tid=1),
        _event("cuda_runtime", "cudaStreamSynchronize", 150, 2, tid=1),  # after the step
        _event("kernel", "sm90_xmma_gemm_bf16", 30, 10, correlation=1),
        _event("kernel", "flash_fwd_kernel", 35, 10, correlation=2),  # overlaps the gemm: busy 30..45
        _event("kernel", "vectorized_elementwise_kernel", 50, 5, correlation=3),
        _event("cpu_op", "aten::mm", 5, 1),
    ]
    got = gpu_profile.analyse_trace({"traceEvents": events})
    assert got["kernels"] == 3 and got["kernel_ms"] == pytest.approx(0.025)
    assert got["gpu_busy_ms"] == pytest.approx(0.020) and got["gpu_busy_share"] == pytest.approx(0.2)
    assert got["kernel_ms_by_kind"] == pytest.approx({"matmul": 0.01, "attention": 0.01, "elementwise": 0.005})
    assert got["kernel_ms_by_phase"] == pytest.approx(
        {"chunk_backwards": 0.01, "layer_backward": 0.01, "outside": 0.005}
    )
    assert got["launches"] == 3 and got["sync_calls"] == {"cudaStreamSynchronize": 1}
    assert got["cpu_ops"] == 1 and got["step_span_ms"] == pytest.approx(0.1)


@pytest.mark.slow
def test_end_to_end_on_the_cpu(tmp_path):
    gpu_profile.main(
        ["--device", "cpu", "--model", "qwen3-tiny", "--dtype", "float32", "--seq-len", "128", "--warmup-seq-len",
         "32", "--repeats", "1", "--extra-lengths", "96", "--configs", "trl", "stream:32", "--profile", "stream:32",
         "--out-dir", str(tmp_path), "--name", "prof"]
    )  # fmt: skip
    result = json.loads((tmp_path / "prof.json").read_text())
    trl, stream = result["records"]
    assert trl["config"] == "trl" and "profile" not in trl and trl["step_s"] > 0
    assert [s["seq_len"] for s in trl["extra_steps_s"]] == [96] and trl["extra_steps_s"][0]["backward"] > 0
    assert {"layer_forward", "collect_kv", "chunk_backwards", "layer_backward"} <= set(stream["phases_s"])
    assert stream["profile"]["cpu_ops"] > 0 and stream["profile"]["kernels"] == 0  # no GPU: no kernels
    assert result["environment"]["device"] == "cpu"
