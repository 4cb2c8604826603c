"""How far one parameter's bf16 gradient lies from a float64 reference, for plain steps that differ only in rounding
(SDPA or eager attention, HF gradient checkpointing) beside streamed steps at several chunk sizes, on a tiny model of
the sweep, over seeds and paddings. A markdown table on stdout.

It tells a streamed step's bf16 error apart from the spread of the plain steps' own: a gradient that is a sum over
every position whose terms nearly cancel (Gated DeltaNet's ``dt_bias``: four numbers, each a sum over ~1000
positions) lands one or two bf16 units from the reference by the luck of its rounding, and a ratio to one plain
step's error says little. Example (``benchmarks/cpu_bf16_dt_bias_spread.md``)::

    python scripts/cpu.py bf16-spread --family qwen3_5_text --param model.layers.0.linear_attn.dt_bias
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

from streambp_trl import enable_streambp

from .common import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests"))  # the tiny-model zoo and helpers live in tests/
from model_support import Float64Internals  # noqa: E402
from zoo import batch, tiny_causal_lm  # noqa: E402


def _gradient(model: torch.nn.Module, inputs: tuple, name: str) -> torch.Tensor:
    ids, mask, labels = inputs
    model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    return dict(model.named_parameters())[name].grad.double()


def _steps(model: torch.nn.Module, chunks: list[int]) -> dict[str, torch.nn.Module]:
    """The bf16 models of one comparison: plain (two attention kernels, HF checkpointing) and streamed."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    eager = copy.deepcopy(low)
    eager.set_attn_implementation("eager")
    checkpointed = copy.deepcopy(low)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    steps = {"plain (SDPA)": low, "plain (eager)": eager, "HF checkpointing": checkpointed}
    for chunk in chunks:
        steps[f"stream {chunk}"] = enable_streambp(copy.deepcopy(low), stream_chunk_size=chunk, logits_chunk_size=96)
    return steps


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen3_5_text")
    parser.add_argument("--param", default="model.layers.0.linear_attn.dt_bias")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--paddings", nargs="+", default=["none", "right", "left"])
    parser.add_argument("--seq-len", type=int, default=515)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 1024])
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    header = None
    for seed in args.seeds:
        model = tiny_causal_lm(args.family, seed=seed)
        for padding in args.paddings:
            inputs = batch(2, args.seq_len, padding=padding, seed=seed)
            with Float64Internals():
                reference = _gradient(copy.deepcopy(model), inputs, args.param)
            errors = {
                label: ((_gradient(m, inputs, args.param) - reference).norm() / reference.norm()).item()
                for label, m in _steps(model, args.chunks).items()
            }
            if header is None:
                header = ["seed", "padding", *errors]
                print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            print(f"| {seed} | {padding} | " + " | ".join(f"{e:.1e}" for e in errors.values()) + " |", flush=True)
