"""Where and with what a measurement ran: device, versions, git commit, and a hash of the engine's sources."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding streambp_trl/


def engine_hash() -> str:
    """First 12 hex digits of a SHA-256 over the ``streambp_trl`` sources: which engine code ran."""
    import hashlib

    digest = hashlib.sha256()
    root = PACKAGE_ROOT / "streambp_trl"
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def environment(device: str) -> dict[str, Any]:
    """Where and with what a measurement runs: device, versions, git commit, engine hash, date."""
    import torch
    import transformers
    import trl

    import streambp_trl

    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "streambp_trl": streambp_trl.__version__,
        },
        "git": git_commit(),
        "engine_sha256": engine_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
