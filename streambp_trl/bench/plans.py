"""What ``stream_chunk_size="auto"`` would plan at each length, for ``streambp-trl max-len``: the same planner the
engine runs per call (:class:`streambp_trl.sizing.plan.Planner`), on the memory model's shape of the model, within
the estimate's budget less the plan's fragmentation margin, with a host memory for offload."""

from __future__ import annotations

from typing import Any

from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.auto import host_room
from streambp_trl.sizing.plan import Planner, margin
from streambp_trl.sizing.units import size_text

FIRST_LENGTH = 16384


def plan_rows(
    shape: mm.ModelShape,
    setup: mm.StepSetup,
    budget: int,
    host: int | None = None,
    lengths: list[int] | None = None,
    keep_every: int | None = None,
    kv_mode: str | None = None,
) -> dict[str, Any]:
    """For each length (default: 16,384 doubled up to the longest any plan fits, and that longest), what the plan
    would run and its predicted peak (weights, gradients and optimizer state included) and pinned host bytes, or
    ``None`` where nothing fits; and the longest length each way of running allows. ``keep_every``, ``kv_mode``: the
    user's fixed choices (``None``: planned, as the trainers leave them)."""
    host = host_room() if host is None else host
    static = mm.static_bytes(shape, setup)
    limit = budget - static - margin(budget)
    trained = mm.lora_layer_params(shape) if setup.lora else None
    planner = Planner(
        shape,
        db=setup.dtype_bytes,
        head_trained=not setup.lora,
        adapters=setup.lora,
        chunk=setup.chunk,
        keep_every=keep_every,
        layer_trained_params=trained,
        pending_grads=setup.pending_grads,
        kv_mode=kv_mode,
    )
    longest = planner.longest(setup.rows, limit, host, rebuildable=True, can_offload=True)
    reach = max(longest.values(), default=0)
    if lengths is None:
        lengths = [n for n in (FIRST_LENGTH << k for k in range(20)) if n < reach] + ([reach] if reach else [])
    rows = []
    for n in lengths:
        plan = planner.best(setup.rows, n, limit, host, rebuildable=True, can_offload=True)
        rows.append(
            {
                "tokens": n,
                "plan": None if plan is None else plan.describe(n, shape.layers),
                "chunk": None if plan is None else plan.chunk,
                "layout": None if plan is None else {"every": plan.layout.every, "drop": plan.layout.drop},
                "offload": None if plan is None else plan.offload,
                "capture": None if plan is None else plan.capture,
                "peak_bytes": None if plan is None else static + plan.activations,
                "host_bytes": None if plan is None else plan.host,
            }
        )
    return {"budget_bytes": budget, "margin_bytes": margin(budget), "host_bytes": host, "longest": longest,
            "rows": rows}  # fmt: skip


def render_plans(result: dict[str, Any]) -> str:
    """The plans as a table, with the longest length each way of running allows under it."""
    lines = [
        f'What stream_chunk_size="auto" would plan (the engine\'s planner on the same estimate, within '
        f"{size_text(result['budget_bytes'])} less {size_text(result['margin_bytes'])} for fragmentation, with "
        f"{size_text(result['host_bytes'])} of host memory to pin; --host-memory to change it):",
        "",
        "| tokens per sequence | plan | predicted peak | pinned host |",
        "|---:|---|---:|---:|",
    ]
    for row in result["rows"]:
        if row["plan"] is None:
            lines.append(f"| {row['tokens']:,} | does not fit | - | - |")
            continue
        plan = row["plan"].split(": ", 1)[1]
        host = size_text(row["host_bytes"]) if row["offload"] else "-"
        lines.append(f"| {row['tokens']:,} | {plan} | {size_text(row['peak_bytes'])} | {host} |")
    ways = "; ".join(f"{way}: {tokens:,}" for way, tokens in result["longest"].items()) or "none fits any length"
    lines += ["", f"Longest length per sequence, each way of running (at the smallest chunk): {ways}."]
    return "\n".join(lines)
