"""One plan per call shape (``streambp_trl.sizing.plan``): the chunk, which layer inputs are kept and whether they
are offloaded, chosen from the memory model and a time model within the memory budget, exact whatever it chooses,
the user's own choices kept, and a clear error where nothing fits."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from helpers import RECOMPUTED, CopyingOffload, count_calls, loss_and_grads, reference_loss
from models import batch, tiny_model
from transformers.utils import logging as hf_logging

from streambp_trl import StreamOptions, enable_streambp
from streambp_trl.bench.plans import plan_rows, render_plans
from streambp_trl.layers.call import backward, layer_call
from streambp_trl.sizing import auto, room, stream_step
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.choices import PlanChoices, StepPlan, Trained
from streambp_trl.sizing.layout import Layout
from streambp_trl.sizing.plan import Planner, margin, predicted_time

LAYERS = 6
CHUNK = 4


def test_layouts_segment_the_layers():
    """Dropping d inputs below the top layer makes segments of two at L-3/L-2, L-5/L-4, ...; keep_every k segments of
    k; the memory model's worst backward then holds d fewer inputs (36 layers: 35 kept beside dY with every input
    kept, the first layer's being rebuilt from the token ids)."""
    assert Layout(drop=1).segments(6) == [(0, 1), (1, 1), (2, 1), (3, 2), (5, 1)]
    assert Layout(drop=2).segments(6) == [(0, 1), (1, 2), (3, 2), (5, 1)]
    assert Layout(every=4).segments(6) == [(0, 4), (4, 2)]
    assert [Layout(drop=d).rebuilt(36) for d in (0, 1, 17)] == [0, 1, 17] and Layout.drops(36) == 17
    with pytest.raises(ValueError):
        Layout(every=2, drop=1)
    shape = mm.ModelShape.from_name("qwen3-8b")
    keep_all = mm.estimate_activation_bytes(shape, 163840, StepPlan(2048))
    for d in (1, 2, 5):
        dropped = mm.estimate_activation_bytes(shape, 163840, StepPlan(2048, Layout(drop=d)))
        assert keep_all - dropped == d * shape.hidden * 2 * 163840  # d full-length bf16 inputs fewer at the peak


def test_plans_for_qwen3_8b_on_an_80gb_card():
    """Qwen3-8B, full fine-tuning, 78 GiB: at 163,840 tokens in chunks of 2048 every input kept is predicted over the
    budget less its 1 GiB margin, one rebuilt input fits; at 262,144 "auto" offloads where the host has 70 GiB to pin
    and rebuilds inputs where it has 20 GiB; the time model prefers offload to rebuilding many inputs."""
    shape = mm.ModelShape.from_name("qwen3-8b")
    static, budget = mm.static_bytes(shape, mm.StepSetup()), 78 * mm.GiB
    limit = budget - static - margin(budget)
    fixed = Planner(shape, Trained(), PlanChoices(chunk=2048, kv_mode="recompute"))
    assert fixed.estimate(163840, StepPlan(2048, Layout(), False))[0] > limit
    plan = fixed.best(1, 163840, limit, None, True, True)
    assert (plan.chunk, plan.layout, plan.offload) == (2048, Layout(drop=1), False)
    assert static + plan.activations <= 77 * mm.GiB
    big_host = Planner(shape, Trained(), PlanChoices(kv_mode="recompute")).best(
        1, 262144, limit, 100 * mm.GiB, True, True
    )
    assert big_host.offload and big_host.layout == Layout() and big_host.host == 35 * 4096 * 2 * 262144
    small_host = Planner(shape, Trained(), PlanChoices(kv_mode="recompute")).best(
        1, 262144, limit, 20 * mm.GiB, True, True
    )
    assert small_host.layout.rebuilt(36) > 0 and static + small_host.activations <= budget - mm.GiB
    assert predicted_time(StepPlan(4096, Layout(), True), 36) < predicted_time(StepPlan(4096, Layout(every=2)), 36)
    assert "offloaded to host (70.0 GiB pinned)" in big_host.describe(262144, 36, static, budget - static)


def test_plans_capture_keys_values_where_they_fit():
    """Qwen3-8B, full fine-tuning, 78 GiB, gradients formed in backward: at 65,536 tokens the plan keeps every layer's
    keys/values from its forward (the backward then runs no key/value pass), in chunks of 16384 with every input
    kept; at 163,840 tokens they do not fit beside the inputs, and are recomputed; a fixed kv_mode is kept, and offload
    plans recompute them (the plan has not timed capture beside offload's copies)."""
    shape = mm.ModelShape.from_name("qwen3-8b")
    static, budget = mm.static_bytes(shape, mm.StepSetup(pending_grads=True)), 78 * mm.GiB
    limit = budget - static - margin(budget)
    recomputing = {"keep_activations": 0, "keep_attention": False}  # (this test weighs keys/values alone)
    planner = Planner(shape, Trained(pending_grads=True), PlanChoices(kv_mode=None, **recomputing))
    short = planner.best(1, 65536, limit, None, True, True)
    assert (short.kv_mode == "capture", short.chunk, short.layout, short.offload) == (True, 16384, Layout(), False)
    assert "keys/values kept from the forward" in short.describe(65536, 36)
    recomputed = Planner(shape, Trained(pending_grads=True), PlanChoices(kv_mode="recompute", **recomputing)).best(
        1, 65536, limit, None, True, True
    )  # kv_mode="recompute"
    assert recomputed.kv_mode == "recompute" and recomputed.time > short.time
    assert short.activations - recomputed.activations == 35 * 2 * shape.kv_dim * 2 * 65536  # the layers below the top
    # a segment of kept inputs holds every input of its layers at its top layer's backward, beside the keys/values
    # captured below that layer (6 layers in segments of 3: the top layer's 5 below, not the segment's lowest's 3)
    assert stream_step._saved_inputs(6, Layout(every=3), False, None, 100, 0, lambda j: j) == 3 * 100 + 5
    long = planner.best(1, 163840, limit, 100 * mm.GiB, True, True)
    assert long.kv_mode == "recompute" and "keys/values" not in long.describe(163840, 36)
    assert planner.kv_modes(offload=True, layout=Layout()) == ["recompute"]
    assert planner.kv_modes(offload=False, layout=Layout(drop=1)) == ["recompute"]  # not traded for rebuilt inputs
    indexed = dataclasses.replace(shape, index_heads=64, index_head_dim=128)  # its indexer keys are counted too
    assert Planner(indexed, Trained(), PlanChoices(kv_mode=None)).kv_modes(offload=False, layout=Layout()) == [
        "recompute",
        "capture",
    ]
    assert mm.captured_bytes(indexed, 1024, 512)[0] - mm.captured_bytes(shape, 1024, 512)[0] == 128 * 2 * 1024
    assert Planner(shape, Trained(), PlanChoices(kv_mode="capture")).kv_modes(offload=False, layout=Layout()) == [
        "capture"
    ]


def test_a_planned_capture_is_exact_and_skips_the_key_value_pass(monkeypatch):
    """Where the keys/values fit, the plan keeps them from the forward: no layer's backward runs the key/value pass,
    and the gradient is bit for bit that of recomputing them (float64); under a budget they do not fit in (but the
    recompute does) the plan recomputes them."""
    collected = count_calls(monkeypatch, backward.ChunkBackward, "collect_kv", lambda self, x: self.call.layer)
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch(padding="left")
    recompute = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, kv_mode="recompute", **RECOMPUTED)
    loss, grads = loss_and_grads(recompute, ids, mask, labels)
    assert len(collected) == LAYERS
    planned = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, memory_budget="1GiB", **RECOMPUTED)
    loss_planned, grads_planned = loss_and_grads(planned, ids, mask, labels)
    assert (planned._streambp.auto.last_plan.kv_mode == "capture") and len(collected) == LAYERS
    assert torch.equal(loss, loss_planned)
    for name, g in grads.items():
        assert torch.equal(g, grads_planned[name]), name
    plain = copy.deepcopy(model)
    loss_plain = reference_loss(plain, ids, mask, labels)
    loss_plain.backward()
    assert abs(loss_plain.item() - loss_planned.item()) < 1e-12
    for name, p in plain.named_parameters():
        assert (p.grad - grads_planned[name]).norm() <= 1e-10 * p.grad.norm(), name
    shape = mm.ModelShape.from_model(model)
    planner = Planner(shape, Trained(db=8, pending_grads=True), PlanChoices(chunk=CHUNK, kv_mode="recompute"))
    need = [
        planner.estimate(ids.numel(), StepPlan(CHUNK, Layout(), False, kv_mode="capture" if capture else "recompute"))[
            0
        ]
        for capture in (False, True)
    ]
    assert need[0] < need[1]
    budget = sum(p.numel() * 8 for p in model.parameters()) + (need[0] + need[1]) // 2
    tight = enable_streambp(
        model, stream_chunk_size=CHUNK, keep_every=1, memory_budget=f"{budget + margin(budget)}B", **RECOMPUTED
    )
    loss_tight, _ = loss_and_grads(tight, ids, mask, labels)
    assert not (tight._streambp.auto.last_plan.kv_mode == "capture") and len(collected) == 2 * LAYERS
    assert torch.equal(loss, loss_tight)


def _budget_between(model, tokens: int, low: Layout, high: Layout, pending: bool = True) -> int:
    """A memory budget under which ``low`` fits and ``high`` does not (as the memory model predicts them), for a step
    whose backward forms the parameter gradients (``pending``: the model holds none, as a fresh one) or one that holds
    them through the step."""
    shape = mm.ModelShape.from_model(model)
    planner = Planner(shape, Trained(db=8, pending_grads=pending), PlanChoices(chunk=CHUNK, kv_mode="recompute"))
    params = sum(p.numel() * 8 for p in model.parameters())
    need = [planner.estimate(tokens, StepPlan(CHUNK, layout, False))[0] for layout in (low, high)]
    assert need[0] < need[1]
    budget = (1 if pending else 2) * params + (need[0] + need[1]) // 2
    return budget + margin(budget)


def test_a_planned_rebuild_is_exact_and_said(monkeypatch, caplog):
    """A budget that every input kept does not fit but one rebuilt input does: the plan rebuilds it (one layer forward
    replayed in backward), says so at warning level, and the gradient is plain autograd's (float64), bit for bit that
    of every input kept."""
    replayed = []
    replay_chunks = layer_call.LayerCall.replay_chunks

    def counted(self, x, record):
        replayed.append(True)
        return replay_chunks(self, x, record)

    monkeypatch.setattr(layer_call.LayerCall, "replay_chunks", counted)
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch(padding="left")
    budget = _budget_between(model, ids.numel(), Layout(drop=1), Layout())
    kept = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, keep_every=1)
    loss, grads = loss_and_grads(kept, ids, mask, labels)
    planned = enable_streambp(model, stream_chunk_size=CHUNK, memory_budget=f"{budget}B")
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        loss_planned, grads_planned = loss_and_grads(planned, ids, mask, labels)
    assert planned._streambp.auto.last_plan.layout == Layout(drop=1)
    assert sum(replayed) == 1
    said = caplog.text
    assert "1 layer input rebuilt in backward" in said and f"{ids.numel():,} tokens: chunk {CHUNK}" in said
    assert torch.equal(loss, loss_planned)
    for name, g in grads.items():
        assert torch.equal(g, grads_planned[name]), name
    plain = tiny_model("qwen3", num_hidden_layers=LAYERS)
    loss_plain = reference_loss(plain, ids, mask, labels)
    loss_plain.backward()
    assert abs(loss_plain.item() - loss.item()) < 1e-12
    for name, p in plain.named_parameters():
        assert (p.grad - grads[name]).norm() <= 1e-10 * p.grad.norm(), name


def test_the_users_choices_are_kept():
    """keep_every=1 (or offload_checkpoints=False) set by the user is never overridden: with a budget that only a
    rebuilt input fits, the plan keeps every input and, on a step with grad, says that nothing fits; keep_every=2
    is kept where every input would fit."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    budget = _budget_between(model, ids.numel(), Layout(drop=1), Layout())
    fixed = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, memory_budget=f"{budget}B", keep_every=1)
    with pytest.raises(ValueError, match="fit in no way of running within memory_budget") as error:
        fixed(input_ids=ids, attention_mask=mask, labels=labels)
    assert "as configured" in str(error.value) and "Longest lengths per sequence" in str(error.value)
    roomy = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, keep_every=2, memory_budget="1GiB")
    roomy(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert roomy._streambp.auto.last_plan.layout == Layout(every=2)


def test_nothing_fits_is_refused_before_the_step_with_the_longest_lengths():
    """A budget below what any way of running needs: the first forward with grad raises, naming the longest length
    each way would allow, or here, where the gradients alone exceed it, that no length fits; the same call without
    grad (a reference model's pass) runs at the smallest chunk."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    params = sum(p.numel() * 8 for p in model.parameters())
    streamed = enable_streambp(model, stream_chunk_size="auto", memory_budget=f"{2 * params + 64}B")
    with pytest.raises(ValueError, match=r"fit in no way of running .* No length per sequence fits in any way"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        streamed(input_ids=ids, attention_mask=mask, labels=labels)


def test_a_planned_offload_is_exact(monkeypatch):
    """Where the plan offloads (here a budget that only offload fits, on a device that moves the CPU tensors as a
    GPU would), the gradient is that of every input kept on the device, bit for bit."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    shape = mm.ModelShape.from_model(model)
    planner = Planner(
        shape, Trained(db=8, pending_grads=True), PlanChoices(chunk=CHUNK, keep_every=1, kv_mode="recompute")
    )
    params = sum(p.numel() * 8 for p in model.parameters())
    on_device = planner.estimate(ids.numel(), StepPlan(CHUNK, Layout(), False))[0]
    offloaded = planner.estimate(ids.numel(), StepPlan(CHUNK, Layout(), True))[0]
    assert offloaded < on_device
    budget = params + (on_device + offloaded) // 2
    budget += margin(budget)
    kept = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, keep_every=1, offload_checkpoints=False)
    loss, grads = loss_and_grads(kept, ids, mask, labels)
    planned = enable_streambp(model, stream_chunk_size=CHUNK, keep_every=1, memory_budget=f"{budget}B")
    offload = CopyingOffload()
    planned._streambp.offloader = offload
    monkeypatch.setattr(auto, "offload_saves", lambda device: True)
    loss_planned, grads_planned = loss_and_grads(planned, ids, mask, labels)
    assert planned._streambp.auto.last_plan.offload and any(kind == "save" for kind, _ in offload.events)
    assert torch.equal(loss, loss_planned)
    for name, g in grads.items():
        assert torch.equal(g, grads_planned[name]), name


def test_offload_asked_for_on_the_cpu_is_planned_as_none():
    """``offload_checkpoints=True`` with a budget on the CPU, where offload keeps the checkpoints where they are: the
    plan sizes the step as without offload (it used to find no plan, while naming a length that fits) and keeps the
    offload asked for; the gradient is that of offload off, bit for bit."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    kept = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, keep_every=1, offload_checkpoints=False)
    loss, grads = loss_and_grads(kept, ids, mask, labels)
    asked = enable_streambp(model, stream_chunk_size=CHUNK, offload_checkpoints=True, memory_budget="1GiB")
    loss_asked, grads_asked = loss_and_grads(asked, ids, mask, labels)
    plan = asked._streambp.auto.last_plan
    assert plan.offload and plan.host == 0 and plan.layout == Layout()
    assert torch.equal(loss, loss_asked)
    for name, g in grads.items():
        assert torch.equal(g, grads_asked[name]), name


def test_a_micro_step_holding_gradients_takes_its_own_plan(caplog):
    """A budget that every input kept fits while the backward forms the parameter gradients (the model holds none, as
    after a trainer's zero_grad) but not while it holds them (the next micro-step of a gradient accumulation): the
    first call keeps every input, the second, same shape, rebuilds one; the accumulated gradient is that of two steps
    keeping every input, bit for bit."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    shape = mm.ModelShape.from_model(model)
    params = sum(p.numel() * 8 for p in model.parameters())
    pending = Planner(
        shape, Trained(db=8, pending_grads=True), PlanChoices(chunk=CHUNK, kv_mode="recompute")
    ).estimate(ids.numel(), StepPlan(CHUNK, Layout(), False))[0]
    held = Planner(shape, Trained(db=8), PlanChoices(chunk=CHUNK, kv_mode="recompute"))
    keep, drop = (
        held.estimate(ids.numel(), StepPlan(CHUNK, layout, False))[0] for layout in (Layout(), Layout(drop=1))
    )
    budget = 2 * params + (keep + drop) // 2
    budget += margin(budget)
    assert params + pending <= budget - margin(budget) < 2 * params + keep  # the model's claim this test rests on
    kept = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, keep_every=1)
    planned = enable_streambp(model, stream_chunk_size=CHUNK, memory_budget=f"{budget}B")
    layouts = []
    for _ in range(2):
        kept(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        planned(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        layouts.append(planned._streambp.auto.last_plan.layout)
    assert layouts == [Layout(), Layout(drop=1)]
    for (name, p), q in zip(kept.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def _keep_budget():
    """A tiny Qwen3, its batch, its weights' bytes, the activations predicted with every layer input kept and with
    one rebuilt, and a budget that fits the weights and every input kept, just."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    shape = mm.ModelShape.from_model(model)
    params = sum(p.numel() * 8 for p in model.parameters())
    planner = Planner(shape, Trained(db=8, pending_grads=True), PlanChoices(chunk=CHUNK, kv_mode="recompute"))
    keep, drop = (
        planner.estimate(ids.numel(), StepPlan(CHUNK, layout, False))[0] for layout in (Layout(), Layout(drop=1))
    )
    budget = params + keep
    budget += margin(budget) + budget // 1024  # (the margin of the larger budget is a little larger)
    return model, (ids, mask, labels), params, keep, drop, budget


def test_what_the_device_holds_beside_the_model_is_counted_and_planned_again(monkeypatch):
    """On a CUDA device what is allocated when a call starts counts beside the weights where it is more (the
    optimizer's state, allocated by the first optimizer step): under the same budget, a call that finds more allocated
    is planned again within what is left, here rebuilding an input the first call kept."""
    model, (ids, mask, labels), params, keep, drop, budget = _keep_budget()
    assert budget - margin(budget) - (params + (keep - drop) // 2) < keep
    streamed = enable_streambp(model, stream_chunk_size=CHUNK, memory_budget=f"{budget}B")
    monkeypatch.setattr(auto, "REPLAN_STEP", 1)
    layouts = []
    for allocated in (params // 2, params + (keep - drop) // 2):  # the weights alone, then with an optimizer's state
        monkeypatch.setattr(auto, "allocated_bytes", lambda device, allocated=allocated: allocated)
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        streamed.zero_grad(set_to_none=True)
        layouts.append(streamed._streambp.auto.last_plan.layout)
    assert layouts == [Layout(), Layout(drop=1)]


def test_a_kept_plan_is_checked_against_the_room_each_call_has(monkeypatch):
    """A plan is kept per shape and per whole GiB allocated, far coarser than a small budget's margin: a call that
    finds less than a GiB more allocated reused the first call's plan, predicted over its room, and ran unchecked.
    Each call now checks the kept plan against its own room: here it rebuilds an input the first call kept, and a call
    with no room left is refused."""
    model, (ids, mask, labels), params, keep, drop, budget = _keep_budget()
    streamed = enable_streambp(model, stream_chunk_size=CHUNK, memory_budget=f"{budget}B")
    assert auto.REPLAN_STEP == mm.GiB > budget
    layouts = []
    for allocated in (params // 2, params + (keep - drop) // 2):  # the weights alone, then with an optimizer's state
        monkeypatch.setattr(auto, "allocated_bytes", lambda device, allocated=allocated: allocated)
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        streamed.zero_grad(set_to_none=True)
        plan = streamed._streambp.auto.last_plan
        layouts.append(plan.layout)
        assert max(params, allocated) + plan.activations <= budget - margin(budget)
    assert layouts == [Layout(), Layout(drop=1)]
    monkeypatch.setattr(auto, "allocated_bytes", lambda device: budget)
    with pytest.raises(ValueError, match="fit in no way of running within memory_budget"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels)


def test_a_budget_is_checked_whatever_the_user_fixed():
    """Every option fixed (chunk, keep_every=1, offload off, recompute): the budget was never checked, so the weights
    plus 4 KiB ran, while with keep_every=1 alone fixed the same budget was refused. Both are refused now, by the one
    check every plan makes; a budget they fit runs exactly the fixed choices, bit for bit as without a budget."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    params = sum(p.numel() * 8 for p in model.parameters())
    fixed = dict(stream_chunk_size=CHUNK, keep_every=1, offload_checkpoints=False, kv_mode="recompute")
    for options in (fixed, dict(stream_chunk_size=CHUNK, keep_every=1)):
        streamed = enable_streambp(copy.deepcopy(model), memory_budget=f"{params + 4096}B", **options)
        with pytest.raises(ValueError, match="fit in no way of running within memory_budget"):
            streamed(input_ids=ids, attention_mask=mask, labels=labels)
    assert not StreamOptions(**fixed).planned and StreamOptions(**fixed, memory_budget="1GiB").planned
    loss, grads = loss_and_grads(enable_streambp(copy.deepcopy(model), **fixed), ids, mask, labels)
    checked = enable_streambp(model, memory_budget="1GiB", **fixed)
    loss_checked, grads_checked = loss_and_grads(checked, ids, mask, labels)
    plan = checked._streambp.auto.last_plan
    assert (plan.chunk, plan.layout, plan.offload, (plan.kv_mode == "capture")) == (CHUNK, Layout(), False, False)
    assert torch.equal(loss, loss_checked)
    for name, g in grads.items():
        assert torch.equal(g, grads_checked[name]), name


def test_a_refusal_names_settings_and_lengths_that_fit():
    """A refusal's longest lengths: below 1024 tokens the longest that fits (each was 0: "as configured: 0"); a way
    only the plan takes, inputs rebuilt below the top layer, named by the setting that lets it, stream_keep_every
    unset (it was offered as an option of its own, "1 layer input rebuilt in backward: 5,120"); keys/values the user
    captures counted as configured, and recomputing them named where that reaches further (they were left out); where
    nothing fits, one line saying so and what to give."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    ids, mask, labels = batch()
    shape = mm.ModelShape.from_model(model)
    params = sum(p.numel() * 8 for p in model.parameters())
    least = Planner(shape, Trained(db=8, pending_grads=True), PlanChoices(chunk=CHUNK, kv_mode="recompute")).estimate(
        ids.numel(), StepPlan(CHUNK, Layout(drop=2), False)
    )
    budget = params + least[0] + margin(params + least[0]) - 1  # the call's tokens fit in no layout
    streamed = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, memory_budget=f"{budget}B")
    with pytest.raises(ValueError, match="Longest lengths per sequence that would fit: as configured: ") as error:
        streamed(input_ids=ids, attention_mask=mask, labels=labels)
    ways = dict(way.rsplit(": ", 1) for way in str(error.value).split("would fit: ")[1].split(". ")[0].split("; "))
    assert ways.keys() == {"as configured", "stream_keep_every unset (the plan's 2 layer inputs rebuilt in backward)"}
    assert all(0 < int(tokens) < ids.shape[1] for tokens in ways.values())
    fixed = dict(chunk=CHUNK, keep_every=1, offload=False)
    recomputed = Planner(shape, Trained(db=8, pending_grads=True), PlanChoices(kv_mode="recompute", **fixed)).longest(
        2, least[0], None, True, False
    )
    captured = Planner(shape, Trained(db=8, pending_grads=True), PlanChoices(kv_mode="capture", **fixed)).longest(
        2, least[0], None, True, False
    )
    assert captured == {
        "as configured": captured["as configured"],
        "stream_kv_mode=recompute": recomputed["as configured"],
    }
    assert captured["as configured"] < recomputed["as configured"]
    starved = enable_streambp(model, stream_chunk_size=CHUNK, memory_budget=f"{params + 4096}B")
    refusal = r"margin\)\. No length per sequence fits in any way of running: give a larger memory_budget\.$"
    with pytest.raises(ValueError, match=refusal):
        starved(input_ids=ids, attention_mask=mask, labels=labels)
    none = plan_rows(shape, mm.StepSetup(dtype_bytes=8, chunk=CHUNK), params, host=0)  # max-len's plans, likewise
    assert none["longest"] == {} and "(at the smallest chunk): none fits any length." in render_plans(none)


def _log_prob_grads(model, ids, mask, labels) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the summed per-token log-probabilities of a ``fused_lm_head=True`` call (a loss
    that is not a token mean, so the logit kernel's gradient takes the two-node or the fused form)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out.log_probs.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_budget_reaches_the_lm_head_on_the_cpu():
    """The plan says which forms of the logit kernel's gradient fit its room (Qwen3-8B, 32,768 tokens in chunks of
    2048, gradients held: the two-node form's peak 10.5 GiB, the fused form's 12.9, the eager form's 14.7), and on the
    CPU, which has no allocation figure, the head takes among them the one that recomputes least that its loss
    allows: under a budget the fused form (3 vocabulary passes in backward) where it fits, the two-node form (4)
    where it does not. A streamed call on the CPU with a memory_budget takes it so, with plain autograd's gradient
    (float64)."""
    from torch import nn

    from streambp_trl.engine import last_head_form

    shape = mm.ModelShape.from_name("qwen3-8b")
    planner = Planner(shape, Trained(), PlanChoices(chunk=2048, keep_every=1, offload=False, kv_mode="recompute"))
    plan = planner.best(1, 32768, 13 * mm.GiB, None, rebuildable=True, can_offload=False)
    assert plan.head_forms == ("two-node", "fused")
    tight = planner.best(1, 32768, 11 * mm.GiB, None, rebuildable=True, can_offload=False)
    assert tight.head_forms == ("two-node",)
    head, cpu = nn.Linear(8, 16, bias=False), torch.device("cpu")
    for planned, forms, expected in [
        (plan.head_forms, mm.HEAD_FORMS, "fused"),
        (tight.head_forms, mm.HEAD_FORMS, "two-node"),
        (mm.HEAD_FORMS, ("two-node", "fused"), "fused"),  # a loss that is not a token mean: no eager form
        (mm.HEAD_FORMS, mm.HEAD_FORMS, "eager"),
    ]:
        assert room.head_form(head, head, 32, 16, 2**30, cpu, forms, planned=planned) == expected

    model = tiny_model("qwen3", num_hidden_layers=2)
    ids, mask, labels = batch()
    reference = copy.deepcopy(model)
    out = reference(input_ids=ids, attention_mask=mask, use_cache=False)
    logp = torch.log_softmax(out.logits[:, :-1], -1).gather(2, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    logp.masked_fill(labels[:, 1:] == -100, 0).sum().backward()
    streamed = enable_streambp(model, stream_chunk_size=CHUNK, keep_every=1, memory_budget="64MiB")
    grads = _log_prob_grads(streamed, ids, mask, labels)
    assert "fused" in streamed._streambp.auto.last_plan.head_forms and last_head_form(streamed) == "fused"
    for name, p in reference.named_parameters():
        assert (p.grad - grads[name]).norm() <= 1e-10 * p.grad.norm(), name
