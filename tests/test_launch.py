"""The multi-process launch recipes of configs/accelerate/ddp.yaml: they start N processes that train as one DDP group
(on the CPU with gloo, or on GPUs), and a launch that would not (accelerate's ``--cpu``, or processes that cannot form
a group) is refused in one line naming the recipe that works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _accelerate_launch(*args: str, output_dir: Path, train: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file configs/accelerate/ddp.yaml ARGS -m streambp_trl.cli sft`` on the tiny SFT
    config for two steps, from the repository root as the README says (a free port, for runs side by side)."""
    command = [
        *(sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"),
        *("--config_file", "configs/accelerate/ddp.yaml", "--main_process_port", "0", *args),
        *("-m", "streambp_trl.cli", "sft", "--config", "configs/sft_tiny.yaml"),
        *("--max_steps", "2", "--logging_steps", "1", "--output_dir", str(output_dir), *train),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_ddp_config_runs_two_processes_on_the_cpu(tmp_path):
    out = _accelerate_launch("--num_processes", "2", output_dir=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "Training on 2 processes (data parallel, gloo, cpu)" in log
    # two processes of 8 sequences a step: 2 steps are 32 of the ~300 examples (one process: 0.05263)
    assert "'epoch': '0.1053'" in log, log[-2000:]
    # the stream trainers do not ask DDP to search for unused parameters (tests/test_trainer_options.py)
    assert "find_unused_parameters=True" not in log
    assert f"Model saved to {tmp_path}" in log


def test_accelerates_cpu_flag_is_refused_in_one_line(tmp_path):
    """``--cpu`` makes accelerate run the script once, whatever ``--num_processes`` says."""
    out = _accelerate_launch("--cpu", "--num_processes", "2", output_dir=tmp_path)
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("streambp-trl sft: error:")]
    # (one error: accelerate's RuntimeError may repeat the child's stderr, a library's import warning before it:
    # bitsandbytes on a CPU with AVX512-BF16 then pushes the error onto a line of its own)
    assert len(set(errors)) == 1, out.stderr[-3000:]
    assert "`accelerate launch --cpu` starts one process whatever --num_processes says: drop --cpu" in errors[0]
    assert "configs/accelerate/ddp.yaml --num_processes N" in errors[0] and "use_cpu: true" in errors[0]
    assert "'loss'" not in out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs the processes train together (nccl)")
def test_processes_that_would_train_alone_are_refused(tmp_path):
    """Two torchrun processes on a machine without GPUs, with a config that does not say use_cpu: accelerate gives
    each a world of one (its process group unused), and each would train alone on the whole data."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "streambp_trl.cli", "sft", "--config", "configs/sft_tiny.yaml", "--use_cpu", "false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*command, "--bf16", "false", "--output_dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode != 0
    error = (
        "streambp-trl sft: error: 2 processes were launched, but each would train alone: without GPUs set "
        "`use_cpu: true` (--use_cpu true) so that they train as one data-parallel group on the CPU (gloo)"
    )
    # counted, not matched per line: the two processes share the stderr pipe, and a line of one may run on into a
    # line of the other
    assert out.stderr.count(error) == 2 and out.stderr.count("streambp-trl sft: error:") == 2, out.stderr[-3000:]
    assert "'loss'" not in out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_ddp_config_runs_two_processes_on_gpus(tmp_path):
    out = _accelerate_launch("--num_processes", "2", output_dir=tmp_path, train=("--use_cpu", "false"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "Training on 2 processes (data parallel, DDP, cuda)" in log and f"Model saved to {tmp_path}" in log
