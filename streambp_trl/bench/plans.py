"""What ``stream_chunk_size="auto"`` would run, for ``streambp-trl max-len``: the same planner the engine runs per call
(:class:`streambp_trl.sizing.plan.Planner`), on the memory model's shape of the model, within the estimate's budget
less the plan's fragmentation margin, with a host memory for offload: the longest length of each stream row
(:func:`stream_row`), and the plan at each of a list of lengths (:func:`plan_rows`)."""

from __future__ import annotations

from typing import Any

from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.choices import KVMode, PlanChoices, StepPlan
from streambp_trl.sizing.plan import CONFIGURED, Planner, margin
from streambp_trl.sizing.room import host_room
from streambp_trl.sizing.units import size_text

FIRST_LENGTH = 16384


def planner(
    shape: mm.ModelShape,
    setup: mm.StepSetup,
    keep_every: int | None = None,
    offload: bool | None = None,
    kv_mode: KVMode | None = None,
) -> Planner:
    """The engine's planner for a model of ``shape`` run as ``setup`` says (its dtype, LoRA, fixed chunk, pending
    gradients; the logit tile is the chunk, as the engine plans it), with the user's fixed ``keep_every``, ``offload``
    and ``kv_mode`` (``None``: planned, as the trainers leave them)."""
    choices = PlanChoices(chunk=setup.chunk, keep_every=keep_every, offload=offload, kv_mode=kv_mode)
    return Planner(shape, setup.trained(shape), choices, ranks=setup.gpus, masks=setup.masks)


def activation_room(shape: mm.ModelShape, setup: mm.StepSetup, budget: int) -> int:
    """The bytes a plan's activations may take within ``budget``: what the weights, gradients and optimizer state
    leave (:func:`memory_model.static_bytes`), less the fragmentation margin (:func:`streambp_trl.sizing.plan.margin`),
    as the engine's room under a ``memory_budget``."""
    return budget - mm.static_bytes(shape, setup) - margin(budget)


def host_bytes(host: int | None) -> int:
    """The pinned host bytes offload may take: ``host`` (``--host-memory``), else what the engine allows itself on
    this machine (:func:`streambp_trl.sizing.room.host_room`)."""
    return host_room() if host is None else host


def stream_row(
    shape: mm.ModelShape,
    setup: mm.StepSetup,
    budget: int,
    host: int,
    offload: bool,
    keep_every: int | None = None,
    step: int = 1024,
) -> dict[str, Any]:
    """The longest length per sequence (a multiple of ``step``) for which the planner finds a plan with
    ``offload_checkpoints=offload`` within ``budget`` (and ``host`` pinned bytes), and the plan it runs there:
    ``max_len``, ``plan`` (a :class:`StepPlan`, ``None`` where no length fits), its predicted ``peak_bytes`` (the
    weights, gradients and optimizer state included, or the optimizer step's moment where that is more) and its
    pinned ``host_bytes`` (``None`` without offload). Nothing fits where the optimizer step alone is over the budget.
    ``keep_every``: the user's (``None``: planned). With ``setup.gpus`` > 1 the length is the whole sequence's, split
    across the GPUs (``share``: each GPU's tokens, what the plan runs); the budget, peak and host bytes are per GPU."""
    plans = planner(shape, setup, keep_every, offload)
    limit, step_bytes = activation_room(shape, setup, budget), mm.optimizer_step_bytes(shape, setup)
    ways = longest_ways(plans, setup.rows, limit, host, step) if step_bytes <= budget else {}
    share = max(ways.values(), default=0)
    plan = plans.best(setup.rows, share, limit, host, True, True) if share else None
    if plan is None:
        return {"max_len": 0, "share": 0, "plan": None, "peak_bytes": None, "host_bytes": None}
    peak = max(mm.static_bytes(shape, setup) + plan.activations, step_bytes)
    return {
        "max_len": share * setup.gpus,
        "share": share,
        "plan": plan,
        "peak_bytes": peak,
        "host_bytes": plan.host if plan.offload else None,
    }


def least_peak_bytes(
    shape: mm.ModelShape, setup: mm.StepSetup, tokens: int, offload: bool, keep_every: int | None = None
) -> int:
    """The least predicted peak of any plan open to the planner (:func:`planner`) for ``tokens`` tokens per sequence
    with ``offload_checkpoints=offload``: the weights, gradients and optimizer state and the least activations, or the
    optimizer step's moment where that is more."""
    plans = planner(shape, setup, keep_every, offload)
    chunks, layouts, offloads = plans.choices_open(tokens, True, True)
    least = min(
        plans.estimate(setup.rows * tokens, StepPlan(chunk, layout, each), rows=setup.rows)[0]
        for chunk in chunks
        for layout in layouts
        for each in offloads
    )
    return max(mm.static_bytes(shape, setup) + least, mm.optimizer_step_bytes(shape, setup))


def longest_ways(plans: Planner, rows: int, limit: int, host: int, step: int) -> dict[str, int]:
    """:meth:`Planner.longest`'s ways that fit a multiple of ``step`` (max-len's lengths; the engine's refusal also
    names shorter ones), the way that runs as configured named by what it runs: where nothing is fixed, every layer
    input kept (the planner rebuilds inputs only past it)."""
    keep_every = plans.choices.keep_every
    configured = "every layer input kept" if keep_every is None else f"stream_keep_every={keep_every}"
    ways = plans.longest(rows, limit, host, True, True, step)
    return {(configured if way == CONFIGURED else way): tokens for way, tokens in ways.items() if tokens >= step}


def plan_rows(
    shape: mm.ModelShape,
    setup: mm.StepSetup,
    budget: int,
    host: int,
    lengths: list[int] | None = None,
    keep_every: int | None = None,
    kv_mode: KVMode | None = None,
    also: tuple[int, ...] = (),
    step: int = 1024,
) -> dict[str, Any]:
    """For each length (default: 16,384 doubled up to the longest any plan fits, that longest, and the lengths
    ``also`` names), what the plan would run and its predicted peak (weights, gradients and optimizer state included)
    and pinned host bytes, or ``None`` where nothing fits; and the longest length (a multiple of ``step``) each way of
    running allows. ``keep_every``, ``kv_mode``: the user's fixed choices (``None``: planned,
    as the trainers leave them); offload is planned within ``host`` pinned bytes."""
    static = mm.static_bytes(shape, setup)
    limit = activation_room(shape, setup, budget)
    plans = planner(shape, setup, keep_every, None, kv_mode)
    longest = longest_ways(plans, setup.rows, limit, host, step)
    reach = max(longest.values(), default=0)
    if lengths is None:
        doubled = [n for n in (FIRST_LENGTH << k for k in range(20)) if n < reach]
        lengths = sorted({*doubled, reach, *(n for n in also if n)} - {0})
    rows = []
    for n in lengths:
        plan = plans.best(setup.rows, n, limit, host, rebuildable=True, can_offload=True)
        rows.append(
            {
                "tokens": n,
                "plan": None if plan is None else plan.describe(n, shape.layers),
                "chunk": None if plan is None else plan.chunk,
                "layout": None if plan is None else {"every": plan.layout.every, "drop": plan.layout.drop},
                "offload": None if plan is None else plan.offload,
                "capture": None if plan is None else plan.kv_mode == KVMode.CAPTURE,
                "layers_kept": None if plan is None else min(plan.keep_activations, shape.layers),
                "attention_kept": None if plan is None else plan.keep_attention,
                "peak_bytes": None if plan is None else static + plan.activations,
                "host_bytes": None if plan is None else plan.host,
            }
        )
    return {"budget_bytes": budget, "margin_bytes": margin(budget), "host_bytes": host, "longest": longest,
            "rows": rows}  # fmt: skip


def describe_layout(plan: StepPlan | None, layers: int) -> str:
    """How ``plan`` keeps the layer inputs where it rebuilds some in backward, for a row's label ("" where it keeps
    every one, or there is no plan)."""
    if plan is None or not plan.layout.rebuilt(layers):
        return ""
    return plan.layout.describe(layers)


def render_plans(result: dict[str, Any]) -> str:
    """The plans as a table (none where no length is asked for or fits), with the longest length each way of running
    allows under it."""
    lines = [
        'What stream_chunk_size="auto" would plan at each length, stream_keep_every and offload_checkpoints left to '
        "the plan as the trainers leave them (the same planner, room and host memory as the stream rows):",
        "",
        "| tokens per sequence | plan | predicted peak | pinned host |",
        "|---:|---|---:|---:|",
    ]
    lines = lines if result["rows"] else []
    for row in result["rows"]:
        if row["plan"] is None:
            lines.append(f"| {row['tokens']:,} | does not fit | - | - |")
            continue
        plan = row["plan"].split(": ", 1)[1]
        host = size_text(row["host_bytes"]) if row["offload"] else "-"
        lines.append(f"| {row['tokens']:,} | {plan} | {size_text(row['peak_bytes'])} | {host} |")
    ways = "; ".join(f"{way}: {tokens:,}" for way, tokens in result["longest"].items()) or "none fits any length"
    lines += [
        *([""] if lines else []),
        f"Longest length per sequence, each way of running (at the smallest chunk): {ways}.",
    ]
    return "\n".join(lines)
