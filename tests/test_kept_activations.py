"""Layers that keep their activations from the forward (the plan's ``keep_activations``): their backward recomputes
nothing, their gradients are bit for bit those of recomputing them, the memory model counts what they hold, and the
plan keeps as many of the top layers as its room holds (every one where the room holds them all)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import count_calls, reference_loss
from model_support import CHUNK as ZOO_CHUNK
from model_support import NOT_BUILDABLE, UNPADDED, Float64Internals, support_table
from models import batch, tiny_model
from zoo import ZOO_TYPES, tiny_causal_lm
from zoo import batch as zoo_batch

from streambp_trl import StreamOptions, enable_streambp
from streambp_trl.attention import causal_chunk, kept_outputs
from streambp_trl.bench.simulator import record_setup, record_shape
from streambp_trl.engine import last_plan, plan_fields
from streambp_trl.layers.call import backward, stream_layer
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.choices import PlanChoices, StepPlan, Trained
from streambp_trl.sizing.layout import Layout
from streambp_trl.sizing.plan import Planner, attention_share, predicted_time

CHUNK = 4
MODELS = {
    "dense, attention dropout": lambda: tiny_model("llama", attention_dropout=0.2),
    "sliding window": lambda: tiny_model("mistral"),  # a window of 5 keys over chunks of 4
    "hybrid": lambda: tiny_causal_lm("qwen3_5_text"),  # a Gated DeltaNet layer under a full-attention one
}


def _seeded_step(model, ids, mask, labels, seed: int = 0):
    torch.manual_seed(seed)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kept_layers_recompute_nothing_and_match_recomputing_bit_for_bit(name, monkeypatch):
    """Float64, dropout drawn in the forward: with the top layer kept and with every layer kept, the loss and every
    gradient are equal (``torch.equal``) to those of recomputing every layer, and the kept layers' backwards run no
    chunk recompute and no key/value pass; both agree with plain autograd to 1e-10 (the hybrid's float32 internals
    computed in float64)."""
    with Float64Internals() if name == "hybrid" else contextlib.nullcontext():
        _kept_against_recomputed(name, monkeypatch)


def _kept_against_recomputed(name, monkeypatch):
    model = MODELS[name]()
    layers = model.config.num_hidden_layers
    ids, mask, labels = batch(padding="right")
    recomputed = count_calls(monkeypatch, backward.ChunkBackward, "build", lambda self, *a, **k: k.get("kept", False))
    collected = count_calls(monkeypatch, backward.ChunkBackward, "collect_kv", lambda self, x: self.call.layer)
    options = {"stream_chunk_size": CHUNK, "kv_mode": "recompute", "keep_every": 1}
    reference = enable_streambp(copy.deepcopy(model), keep_activations=0, **options)
    loss, grads = _seeded_step(reference, ids, mask, labels)
    chunks = -(-ids.shape[1] // CHUNK)
    assert recomputed.count(False) == layers * chunks and len(collected) == layers
    for kept in (1, layers):
        recomputed.clear()
        collected.clear()
        streamed = enable_streambp(copy.deepcopy(model), keep_activations=kept, **options)
        loss_kept, grads_kept = _seeded_step(streamed, ids, mask, labels)
        assert recomputed.count(False) == (layers - kept) * chunks, recomputed  # backward recomputes
        assert recomputed.count(True) == kept * chunks  # graphs built in the forward
        assert len(collected) == layers - kept
        assert torch.equal(loss, loss_kept)
        assert grads.keys() == grads_kept.keys()
        for n, g in grads.items():
            assert torch.equal(g, grads_kept[n]), n
    if "dropout" in name:
        return  # (plain autograd draws other dropout masks)
    plain = copy.deepcopy(model)
    loss_plain = reference_loss(plain, ids, mask, labels)
    loss_plain.backward()
    assert abs(loss_plain.item() - loss.item()) <= 1e-12 * abs(loss.item())
    for n, p in plain.named_parameters():
        assert (p.grad - grads[n]).norm() <= 1e-10 * p.grad.norm(), n


def test_kept_layers_with_lora_left_padding_and_packed_rows():
    """LoRA adapters (with dropout) on a left-padded batch, and one packed row of three documents: every layer kept
    gives the gradients of recomputing every layer, bit for bit."""
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids, mask, labels = batch(padding="left")
    options = {"stream_chunk_size": CHUNK, "kv_mode": "recompute", "keep_every": 1}
    got = [
        _seeded_step(enable_streambp(copy.deepcopy(model), keep_activations=k, **options), ids, mask, labels)
        for k in (0, 2)
    ]
    assert torch.equal(got[0][0], got[1][0])
    for n, g in got[0][1].items():
        assert torch.equal(g, got[1][1][n]), n
    plain = tiny_model("qwen3")
    ids = torch.randint(3, plain.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in (7, 9, 5)])[None]
    steps = []
    for k in (0, 2):
        streamed = enable_streambp(copy.deepcopy(plain), keep_activations=k, **options)
        loss = streamed(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        steps.append((loss.detach(), {n: p.grad for n, p in streamed.named_parameters()}))
    assert torch.equal(steps[0][0], steps[1][0])
    for n, g in steps[0][1].items():
        assert torch.equal(g, steps[1][1][n]), n


def test_the_memory_model_counts_what_a_kept_layer_holds(monkeypatch):
    """What a kept Qwen3 layer's chunk graphs save (distinct storages other than the weights) and its keys/values'
    gradient sums, per token, against :func:`memory_model.kept_token_bytes`, in bfloat16 and float32 for several
    widths: never under, at most 15% over (the model counts the tensors live at the simulator's peak, of which the
    saved ones are a part: the residual sum, the values' projection and the attention output's copy are held beside
    them; :func:`test_kept_layers_against_the_simulator`)."""
    seen = []
    original = stream_layer.forward_kept

    def counting(call, x, need_dx, need_extra):
        storages: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ran, kept = original(call, x, need_dx, need_extra)
        sums = sum(t.untyped_storage().nbytes() for pair in kept.carry.grads.values() for t in pair)
        seen.append(sum(storages.values()) + sums)
        return ran, kept

    monkeypatch.setattr(stream_layer, "forward_kept", counting)
    tokens = 512
    for dtype in (torch.bfloat16, torch.float32):
        for hidden, intermediate, heads, kv_heads in [(256, 768, 8, 2), (256, 1536, 8, 2), (512, 768, 16, 4)]:
            config = transformers.Qwen3Config(
                hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=32, num_hidden_layers=2, vocab_size=256,
                max_position_embeddings=tokens, attn_implementation="sdpa",
            )  # fmt: skip
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()
            enable_streambp(model, stream_chunk_size=128, keep_activations=1, kv_mode="recompute", verify=False)
            weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen.clear()
            ids = torch.randint(3, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
            (counted,) = seen
            db = torch.finfo(dtype).bits // 8
            predicted = mm.kept_token_bytes(mm.ModelShape.from_model(model), db) * tokens
            assert counted <= predicted <= 1.15 * counted, (dtype, hidden, intermediate, heads, counted, predicted)


def test_the_plan_keeps_the_top_layers_its_room_holds():
    """Qwen3-8B at 16,384 tokens, chunk 4096: each layer kept adds its activations to the predicted peak and takes
    its recompute off the predicted time; within a room that holds k of them and not k + 1, the plan keeps k; with
    room for all, all (a step with no recompute); with none to spare, none. A user's fixed count is kept, and nothing
    is kept where the layer inputs may not be (sharded weights, a call whose hidden states are collected)."""
    shape = mm.ModelShape.from_name("qwen3-8b")
    planner = Planner(shape, Trained(), PlanChoices(chunk=4096, kv_mode="recompute", keep_attention=False))
    tokens = 16384
    base = StepPlan(4096, Layout(), False)
    peaks = [planner.estimate(tokens, dataclasses.replace(base, keep_activations=k))[0] for k in (0, 1, 2, 36)]
    times = [predicted_time(dataclasses.replace(base, keep_activations=k), 36) for k in (0, 1, 2, 36)]
    assert peaks[0] < peaks[1] < peaks[2] < peaks[3] and times[0] > times[1] > times[2] > times[3]
    assert 0 < peaks[2] - peaks[1] <= mm.kept_token_bytes(shape, 2) * tokens
    limit = (peaks[1] + peaks[2]) // 2
    assert planner.best(1, tokens, limit, None, rebuildable=True, can_offload=False).keep_activations == 1
    assert planner.best(1, tokens, peaks[3], None, rebuildable=True, can_offload=False).keep_activations == 36
    assert planner.best(1, tokens, peaks[0], None, rebuildable=True, can_offload=False).keep_activations == 0
    assert planner.best(1, tokens, peaks[3], None, rebuildable=False, can_offload=False).keep_activations == 0
    choices = PlanChoices(chunk=4096, kv_mode="recompute", keep_activations=3, keep_attention=False)
    fixed = Planner(shape, Trained(), choices)
    assert fixed.best(1, tokens, peaks[3], None, rebuildable=True, can_offload=False).keep_activations == 3
    plan = planner.best(1, tokens, limit, None, rebuildable=True, can_offload=False)
    assert "the top 1 layers' activations kept from the forward" in plan.describe(tokens, 36)


def test_a_planned_step_keeps_every_layer_where_they_fit_and_logs_it():
    """A tiny float64 Qwen3 under a 1 GiB budget: every layer keeps its activations (the log's ``stream_layers_kept``),
    and the step is plain autograd's to 1e-10."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    ids, mask, labels = batch(padding="right")
    streamed = enable_streambp(copy.deepcopy(model), stream_chunk_size=CHUNK, memory_budget="1GiB")
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert last_plan(streamed).keep_activations == 3 and plan_fields(streamed)["stream_layers_kept"] == 3
    loss_plain = reference_loss(model, ids, mask, labels)
    loss_plain.backward()
    assert abs(loss.item() - loss_plain.item()) <= 1e-12 * abs(loss_plain.item())
    for (n, p), q in zip(model.named_parameters(), streamed.parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 1e-10 * p.grad.norm(), n


def test_keep_activations_is_checked_when_the_options_are_built():
    assert StreamOptions(stream_chunk_size=8, keep_activations=2).choices.keep_activations == 2
    assert StreamOptions(stream_chunk_size=8, keep_activations=0, keep_every=3).choices.keep_activations == 0
    with pytest.raises(ValueError, match="stream_keep_activations in a config.*number of layers"):
        StreamOptions(stream_chunk_size=8, keep_activations=-1)
    with pytest.raises(ValueError, match="set one of them, not both"):
        StreamOptions(stream_chunk_size=8, keep_activations=2, keep_every=2)


@pytest.mark.slow  # every exact model type of the installed transformers, twice
def test_every_model_type_keeps_its_layers_bit_for_bit():
    """Every model type the support table calls exact: every layer kept gives the loss and every gradient of
    recomputing every layer, ``torch.equal``, on a right-padded batch in chunks of 5. Doge's layer output differs in
    its last bits (1.4e-17) between a forward with grad, which keeps its graph, and one without, which a recompute
    follows: its two per-layer residual scales, which read that output, are held to 1e-15 relative."""
    table = support_table()
    failures = []
    for model_type in ZOO_TYPES:
        if model_type in NOT_BUILDABLE or not table.get(model_type, {}).get("status", "").startswith("exact"):
            continue
        model = tiny_causal_lm(model_type)
        ids, mask, labels = zoo_batch(padding="none" if model_type in UNPADDED else "right")
        options = {"stream_chunk_size": ZOO_CHUNK, "kv_mode": "recompute", "keep_every": 1}
        got = [
            _seeded_step(enable_streambp(copy.deepcopy(model), keep_activations=k, **options), ids, mask, labels)
            for k in (0, 1024)
        ]
        loose = model_type == "doge"
        for n, g in got[0][1].items():
            h = got[1][1].get(n)
            exact = h is not None and (torch.equal(g, h) or (loose and (g - h).norm() <= 1e-15 * g.norm()))
            if not exact:
                failures.append((model_type, n))
        if not (torch.equal(got[0][0], got[1][0]) or (loose and abs(got[0][0] - got[1][0]) <= 1e-15)):
            failures.append((model_type, "loss"))
    assert not failures, failures


@pytest.mark.parametrize("name", ["qwen3", "hybrid"])
def test_kept_attention_outputs_skip_the_attention_kernels_bit_for_bit(name, monkeypatch):
    """Float64, unpadded rows (plainly causal chunks): keeping the attention outputs from the forward, the recompute
    runs no attention forward kernel (half as many as recomputing them: the forward's alone) and the loss and every
    gradient are those of recomputing them, ``torch.equal``. What is kept per layer is the memory model's
    :func:`memory_model.attention_output_bytes`."""
    model = tiny_model("qwen3", num_hidden_layers=3) if name == "qwen3" else tiny_causal_lm("qwen3_5_text")
    ids, mask, labels = batch(padding="none")
    forwards = []
    kernel = causal_chunk._cpu_forward
    monkeypatch.setattr(causal_chunk, "_cpu_forward", lambda *a, **k: forwards.append("forward") or kernel(*a, **k))
    kept_sizes = []
    original_keep = kept_outputs.KeptOutputs.keep

    def keep(self, query, key, out, lse, state):
        kept_sizes.append(out.numel() * out.element_size() + lse.numel() * lse.element_size())
        return original_keep(self, query, key, out, lse, state)

    monkeypatch.setattr(kept_outputs.KeptOutputs, "keep", keep)
    options = {"stream_chunk_size": CHUNK, "kv_mode": "recompute", "keep_every": 1, "keep_activations": 0}
    steps = []
    for attention in (False, True):
        forwards.clear()
        kept_sizes.clear()
        streamed = enable_streambp(copy.deepcopy(model), keep_attention=attention, verify=False, **options)
        steps.append(_seeded_step(streamed, ids, mask, labels))
        steps[-1] += (forwards.count("forward"),)
    assert steps[1][2] * 2 == steps[0][2] > 0
    assert torch.equal(steps[0][0], steps[1][0])
    for n, g in steps[0][1].items():
        assert torch.equal(g, steps[1][1][n]), n
    shape = mm.ModelShape.from_model(model)
    layers = len(shape.plain_attention_layers)
    assert sum(kept_sizes) == layers * mm.attention_output_bytes(shape, ids.numel(), 8)


def test_the_plan_keeps_attention_outputs_first():
    """Qwen3-8B at 65,536 tokens, chunk 4096: the attention outputs of every layer take less room than one layer's
    activations and save more time, so a room between recomputing everything and holding the attention outputs keeps
    them (and no layer whole); the plan's words name it."""
    shape = mm.ModelShape.from_name("qwen3-8b")
    planner = Planner(shape, Trained(), PlanChoices(chunk=4096, kv_mode="recompute"))
    tokens = 65536
    base = StepPlan(4096, Layout(), False)
    attention = dataclasses.replace(base, keep_attention=True)
    whole = dataclasses.replace(base, keep_activations=1)
    peaks = [planner.estimate(tokens, plan)[0] for plan in (base, attention, whole)]
    share = attention_share(shape, tokens)
    times = [predicted_time(plan, 36, share) for plan in (base, attention, whole)]
    assert peaks[0] < peaks[1] and times[1] < times[2] < times[0]
    limit = peaks[1] + (peaks[1] - peaks[0]) // 4
    plan = planner.best(1, tokens, limit, None, rebuildable=True, can_offload=False)
    assert plan.keep_attention and plan.keep_activations == 0
    assert "attention outputs kept from the forward" in plan.describe(tokens, 36)
    fixed = Planner(shape, Trained(), PlanChoices(chunk=4096, kv_mode="recompute", keep_attention=False))
    assert not fixed.best(1, tokens, limit, None, rebuildable=True, can_offload=False).keep_attention


KEPT_RECORDS = Path(__file__).parents[1] / "benchmarks" / "sim_qwen3_8b_kept.jsonl"


def test_kept_layers_against_the_simulator():
    """Steps whose top layers keep their activations (Qwen3-8B, bfloat16, 16k to 64k tokens, 2 to 36 layers kept,
    gradients formed in backward or held, keys/values recomputed or captured; ``scripts/sim.py grid``): the memory
    model's peak is within 1.1% of the simulator's, and the same plans with no layer kept are predicted more than
    3 GiB lower (what is kept is counted)."""
    records = [json.loads(line) for line in KEPT_RECORDS.read_text().splitlines() if line.startswith("{")]
    assert len(records) >= 5 and {r["stream_kwargs"]["keep_activations"] for r in records} >= {2, 8, 36}
    for r in records:
        setup = record_setup(r)
        assert setup.keep_activations == r["stream_kwargs"]["keep_activations"]
        estimate = mm.gib(mm.estimate_peak_bytes(record_shape(r), setup, r["seq_len"]))
        assert abs(estimate - r["peak_gib"]) <= 0.011 * r["peak_gib"], (r["command"], estimate, r["peak_gib"])
        none_kept = dataclasses.replace(setup, keep_activations=0)
        assert mm.gib(mm.estimate_peak_bytes(record_shape(r), none_kept, r["seq_len"])) < r["peak_gib"] - 3


def test_a_recompute_that_attends_otherwise_than_its_forward_computes_its_attention(monkeypatch):
    """Where a chunk's recompute makes an attention call its forward did not keep (another query shape), the call
    computes its attention (the step stays exact) and a warning says so, once."""
    model = tiny_model("qwen3", num_hidden_layers=2)
    ids, mask, labels = batch(padding="none")
    options = {"stream_chunk_size": CHUNK, "kv_mode": "recompute", "keep_every": 1, "keep_activations": 0}
    reference = _seeded_step(enable_streambp(copy.deepcopy(model), keep_attention=False, **options), ids, mask, labels)
    keep = kept_outputs.KeptOutputs.keep
    kept_outputs._warn_once.cache_clear()
    monkeypatch.setattr(
        kept_outputs.KeptOutputs, "keep", lambda self, q, k, out, lse, state: keep(self, q[:, :1], k, out, lse, state)
    )
    streamed = enable_streambp(copy.deepcopy(model), keep_attention=True, **options)
    with pytest.warns(UserWarning, match="its attention is recomputed"):
        loss, grads = _seeded_step(streamed, ids, mask, labels)
    assert torch.equal(loss, reference[0])
    for n, g in reference[1].items():
        assert torch.equal(g, grads[n]), n
