"""The step counter (streambp_trl.bench.counting) and what it shows of the engine: no host sync inside the layer and
logit loops, and the LM head's matmul passes per form of the logit kernel's gradient."""

import dataclasses

import pytest
import torch

from streambp_trl.bench.counting import StepCounter, allowed_pairs, count_step
from streambp_trl.bench.spec import MeasureSpec


def test_counts_in_place_products_and_causal_pairs():
    a, b, acc = torch.randn(5, 7), torch.randn(7, 3), torch.zeros(5, 3)
    with StepCounter() as counter:
        acc.addmm_(a, b)
        torch.mm(a, b)
        torch.nonzero(acc > 0)
    assert counter.counts.flops == 2 * (2 * 5 * 7 * 3)
    assert len(counter.counts.syncs) == 1 and counter.counts.syncs[0].startswith("nonzero")
    assert allowed_pairs(4, 4, True, None) == 10
    assert allowed_pairs(2, 6, False, torch.ones(1, 1, 2, 6, dtype=torch.bool).tril(4)) == 11


def _spec(mode: str, objective: str = "sft", chunk: int = 128) -> MeasureSpec:
    return MeasureSpec(
        mode=mode,
        seq_len=512,
        model="qwen3-tiny",
        device="cpu",
        dtype="float32",
        objective=objective,
        stream_chunk_size=chunk,
        logits_chunk_size=chunk,
        same_logits_tile=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_stream_step_syncs_once_per_call_and_takes_few_head_passes(objective):
    """SFT's token-mean loss takes the eager form: the LM head's FLOPs are at most plain autograd's (3 vocabulary
    passes, over the scored rows only, where plain autograd computes every position's logits); GRPO's per-token
    weights take the fused form, 4 passes over its scored rows (7/8 of the positions)."""
    stream = count_step(_spec("stream", objective))
    # the host syncs are once per call: as many with half as many layer chunks and logit tiles
    assert count_step(_spec("stream", objective, chunk=256))["syncs"] == stream["syncs"], stream["syncs_by_location"]
    plain = count_step(_spec("checkpoint", objective))  # the model's own loss over stored logits: 3 passes
    ratio = stream["flops_by"]["lm_head"] / plain["flops_by"]["lm_head"]
    assert (0.9 < ratio <= 1.0) if objective == "sft" else (1.0 < ratio <= 4 / 3)


@pytest.mark.slow
def test_recomputes_skip_the_query_projection_and_the_last_mlp_product():
    """q_proj and o_proj each take a forward, a recompute and two backward products under stream, as under
    checkpointing: the pass that collects the keys/values stops before attention and skips the query projection. The
    MLP's products are checkpointing's too: the chunk recompute skips down_proj, whose output only the residual add
    reads (a shape where the attention projections are told apart from the MLP's weights, and a length equal to no
    weight's dimension, since products are attributed to weights by shape)."""
    stream, plain = (
        count_step(dataclasses.replace(_spec(mode), model="qwen3-cpu-bench", seq_len=640))["flops_by"]
        for mode in ("stream", "checkpoint")
    )
    assert stream["q/o_proj"] == plain["q/o_proj"]
    assert stream["mlp"] == plain["mlp"]
    assert stream["k/v_proj"] > plain["k/v_proj"]  # the keys/values themselves are recomputed once more
