"""The memory model's hybrid layer kinds beyond Gated DeltaNet: Mamba2 (Falcon-H1, Bamba, Granite 4 hybrid,
Nemotron-H, Zamba2), Kimi Delta Attention (Kimi Linear, Bailing hybrid), short convolutions (LFM2) and MLP-only
layers (Nemotron-H), read from the tiny configs of :mod:`streambp_trl.bench.causal_lm_zoo`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from streambp_trl.bench.causal_lm_zoo import tiny_causal_lm, tiny_config
from streambp_trl.bench.simulator import record_setup
from streambp_trl.sizing import auto
from streambp_trl.sizing import memory_model as mm

# family: (attention, Gated/Kimi DeltaNet, Mamba2, Mamba2 with attention, short convolution, MLP-only) layers
KINDS = {
    "falcon_h1": ((0, 1), (), (0, 1), (0, 1), (), ()),
    "lfm2": ((1,), (), (), (), (0,), ()),
    "lfm2_moe": ((1,), (), (), (), (0,), ()),
    "nemotron_h": ((2,), (), (0,), (), (), (1, 3)),
    "kimi_linear": ((2,), (0, 1), (), (), (), ()),
    "bailing_hybrid": ((1,), (0,), (), (), (), ()),
    "granitemoehybrid": ((1,), (), (0,), (), (), ()),
    "bamba": ((1,), (), (0,), (), (), ()),
    "zamba2": ((1, 2), (), (0, 1, 2), (1, 2), (), ()),
}


def _kinds(shape: mm.ModelShape) -> tuple:
    return (
        shape.attention_layers,
        shape.linear_layers,
        shape.mamba_layers,
        shape.mamba_attention_layers,
        shape.conv_layers,
        shape.mlp_layers,
    )


@pytest.mark.parametrize("family", sorted(KINDS))
def test_from_config_counts_layers_by_kind(family):
    config = tiny_config(family)
    shape = mm.ModelShape.from_config(config)
    assert _kinds(shape) == KINDS[family]
    assert shape.full_layers == len(KINDS[family][0])
    if shape.mamba_layers:
        heads = getattr(config, "mamba_n_heads", None) or getattr(config, "mamba_num_heads", None)
        heads = heads or config.n_mamba_heads
        d_state = getattr(config, "mamba_d_state", None) or config.ssm_state_size
        assert (shape.mamba_heads, shape.mamba_state, shape.mamba_groups) == (heads, d_state, 1)
        assert shape.mamba_ssm_state == heads * shape.mamba_head_dim * d_state > 0
        assert shape.mamba_kernel == 4 and shape.mamba_chunk > 0
    if shape.conv_layers:
        assert shape.conv_kernel == config.conv_L_cache
    if shape.linear_layers:  # Kimi Delta Attention: as many key as value heads, square states
        assert shape.linear_k_heads == shape.linear_v_heads == config.linear_num_heads
        assert shape.recurrent_state == config.linear_num_heads * config.linear_head_dim**2
        assert shape.linear_kernel == config.linear_conv_kernel_dim


@pytest.mark.parametrize("family", sorted(KINDS))
def test_auto_sizes_these_families_from_their_shape(family):
    """ "auto" builds the shape (no fallback to the rule of thumb) and it holds the model's parameter count."""
    model = tiny_causal_lm(family)
    chunks = auto.AutoChunks(model, budget=None, offload=False)
    assert chunks.shape is not None and _kinds(chunks.shape) == KINDS[family]
    assert chunks.shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("family", "field"),
    [("nemotron_h", "mamba_state"), ("falcon_h1", "mamba_state"), ("lfm2", "conv_kernel")],
)
def test_the_estimate_grows_with_the_carried_state(family, field):
    """More state per token of a state-carrying layer (a larger SSM state, a longer convolution) costs at least its
    carry at every chunk boundary; dropping the kind (every layer counted as attention) changes the estimate."""
    shape = mm.ModelShape.from_config(tiny_config(family))
    if field == "conv_kernel":  # every layer a short convolution (its attention layer's keys/values would be the peak)
        shape = dataclasses.replace(shape, conv_layers=tuple(range(shape.layers)))
    n, chunk = 16384, 2048  # chunks long enough that a layer's backward, not the LM head's, is the peak
    bigger = dataclasses.replace(shape, **{field: getattr(shape, field) * 8})
    if field == "mamba_state":  # the float32 SSM state and the convolution's B/C channels
        per_boundary = (bigger.mamba_ssm_state - shape.mamba_ssm_state) * 4
        per_boundary += (bigger.mamba_conv_dim - shape.mamba_conv_dim) * shape.mamba_kernel * 4
    else:  # the convolution's last inputs
        per_boundary = (bigger.conv_kernel - shape.conv_kernel) * shape.hidden * 4
    added = (n // chunk - 1) * per_boundary
    base = mm.estimate_activation_bytes(shape, n, chunk, chunk, 4)
    assert mm.estimate_activation_bytes(bigger, n, chunk, chunk, 4) >= base + added > base
    plain = dataclasses.replace(
        shape, linear_layers=(), mamba_layers=(), mamba_attention_layers=(), conv_layers=(), mlp_layers=()
    )
    assert mm.estimate_activation_bytes(plain, n, chunk, chunk, 4) != mm.estimate_activation_bytes(
        shape, n, chunk, chunk, 4
    )


SIMULATED = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_hybrid_kinds.json"


def _simulated_nemotron_h() -> list[dict]:
    runs = json.loads(SIMULATED.read_text())["runs"]
    return [r for r in runs if r["model"].endswith("nemo")]


def _nemotron_h_estimate(record: dict) -> float:
    """The model's peak for a simulated Nemotron-H-shaped step (``NemotronHConfig()``'s defaults with the record's
    overrides, full fine-tuning), with the logit kernel's fused form, which the engine takes where memory allows."""
    config = transformers.NemotronHConfig()
    for key, value in record["config"].items():
        setattr(config, key, value)
    with torch.device("meta"):
        shape = mm.ModelShape.from_model(transformers.AutoModelForCausalLM.from_config(config))
    setup = dataclasses.replace(record_setup(record), head_form="fused")
    return mm.gib(mm.estimate_peak_bytes(shape, setup, record["seq_len"]))


def test_mamba2_model_against_the_simulator():
    """Nemotron-H-shaped steps under the simulator (benchmarks/sim_hybrid_kinds.json: chunks 512-2048, d_state, heads
    and SSD block varied, a small and the default vocabulary): the model never under and at most 25% over. The
    Mamba2 layer's chunk backward was fitted to these runs; with its per-block scan broadcast counted per token (the
    earlier term), the small-vocabulary steps, whose peak is that backward, were 2.6-6.7x over."""
    runs = _simulated_nemotron_h()
    assert len(runs) >= 12
    for r in runs:
        estimate = _nemotron_h_estimate(r)
        assert r["peak_gib"] * 0.99 <= estimate <= r["peak_gib"] * 1.25, (r["command"], estimate, r["peak_gib"])
