"""The chunked divergence kernel (``streambp_trl.logits.chunked_divergence``) against plain autograd on the full
logits, in float64: the divergence, the entropy and every student gradient within 1e-10, none for the teacher."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EXACT, ShapeRecorder

from streambp_trl.logits import chunked_divergence

M, N, V, HS, HT = 31, 23, 37, 6, 9  # positions, scored rows, vocabulary, student and teacher widths
TILES = dict(token_chunk=5, vocab_chunk=7)  # dividing neither N nor V


def _transform(y, scale, softcap, temperature):
    y = y * scale
    return (y if softcap is None else softcap * torch.tanh(y / softcap)) / temperature


def _reference(s, t, rows, norms, beta, temperature, s_cap, s_scale, t_cap, t_scale):
    """Plain autograd on the full (N x V) logits of both models."""
    hs, ws, bs = s
    ht, wt, bt = t
    norm, teacher_norm = norms
    ns = norm(hs) if norm is not None else hs
    nt = teacher_norm(ht) if teacher_norm is not None else ht
    zs = _transform(ns[rows] @ ws.T + (0 if bs is None else bs), s_scale, s_cap, temperature)
    zt = _transform(nt[rows] @ wt.T + (0 if bt is None else bt), t_scale, t_cap, temperature)
    log_ps, log_pt = zs.log_softmax(-1), zt.log_softmax(-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        divergence = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:
        divergence = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = torch.logsumexp(torch.stack([log_ps + math.log(1 - beta), log_pt + math.log(beta)]), 0)
        divergence = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    return divergence, -(ps * log_ps).sum(-1)


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    student = (rand(M, HS), rand(V, HS, scale=0.8), rand(V, scale=0.3) if bias else None)
    teacher = (rand(M, HT), rand(V, HT, scale=0.8), rand(V, scale=0.3) if bias else None)
    rows = torch.randperm(M, generator=g)[:N]  # scored rows in any order; the others masked
    norms = (torch.nn.RMSNorm(HS, eps=1e-6, dtype=torch.float64), torch.nn.RMSNorm(HT, eps=1e-6, dtype=torch.float64))
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
    upstream = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return student, teacher, rows, norms, upstream


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize(
    "transform",
    [
        {},
        {"temperature": 0.7},
        {"temperature": 1.3, "student_softcap": 4.0, "teacher_logit_scale": 0.5},
        {"student_logit_scale": 2.0, "teacher_softcap": 3.0},
    ],
    ids=["plain", "temperature", "softcap_scale", "teacher_softcap"],
)
@pytest.mark.parametrize("with_norm", [True, False], ids=["norms", "no_norm"])
@pytest.mark.parametrize("fused_backward", [True, False], ids=["fused", "weight_apart"])
def test_matches_plain_autograd_in_float64(beta, transform, with_norm, fused_backward):
    student, teacher, rows, norms, upstream = _inputs()
    norm, teacher_norm = norms if with_norm else (None, None)
    options = {
        "temperature": 1.0,
        "student_softcap": None,
        "student_logit_scale": 1.0,
        "teacher_softcap": None,
        "teacher_logit_scale": 1.0,
        **transform,
    }
    ref_div, ref_ent = _reference(student, teacher, rows, (norm, teacher_norm), beta, *options.values())
    (ref_div * upstream).sum().backward()
    params = [*student, *(norm.parameters() if norm is not None else ())]
    expected = [p.grad.clone() for p in params]
    teacher_params = [*teacher, *(teacher_norm.parameters() if teacher_norm is not None else ())]
    for p in [*params, *teacher_params]:
        p.grad = None
    div, ent = chunked_divergence(
        *student,
        *teacher,
        beta=beta,
        rows=rows,
        norm=norm,
        teacher_norm=teacher_norm,
        **options,
        **TILES,
        form="fused" if fused_backward else "two-node",
    )
    assert _rel(div, ref_div) < EXACT and _rel(ent, ref_ent) < EXACT
    assert not ent.requires_grad
    (div * upstream).sum().backward()
    for p, grad in zip(params, expected, strict=True):
        assert _rel(p.grad, grad) < EXACT
    assert all(p.grad is None for p in teacher_params)  # the teacher gets no gradient


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_weight_apart_is_the_fused_sweeps_gradient_bit_for_bit(dtype):
    """The weight's gradient formed vocabulary tile by vocabulary tile after the hidden states' sweep (no (V, H)
    accumulator) sums the same products in the same order as the fused sweep: equal bit for bit."""
    grads = []
    for fused in (True, False):
        student, teacher, rows, (norm, teacher_norm), upstream = _inputs()
        student = [t.detach().to(dtype).requires_grad_() for t in student]
        teacher = [t.detach().to(dtype) for t in teacher]
        norm, teacher_norm = norm.to(dtype), teacher_norm.to(dtype)
        div, _ = chunked_divergence(
            *student, *teacher, beta=0.5, rows=rows, norm=norm, teacher_norm=teacher_norm, **TILES,
            form="fused" if fused else "two-node",
        )  # fmt: skip
        (div * upstream.to(dtype)).sum().backward()
        grads.append([p.grad for p in (*student, norm.weight)])
    for fused, apart in zip(*grads, strict=True):
        assert torch.equal(fused, apart)


def test_every_row_no_bias_and_one_tile():
    """rows=None scores every position; one tile larger than everything gives the same as many small ones."""
    student, teacher, _, (norm, _), _ = _inputs(seed=1, bias=False)
    every = torch.arange(M)
    ref_div, _ = _reference(student, teacher, every, (norm, None), 0.5, 1.0, None, 1.0, None, 1.0)
    ref_div.sum().backward()
    expected = [p.grad.clone() for p in (student[0], student[1], norm.weight)]
    for p in (student[0], student[1], norm.weight):
        p.grad = None
    div, _ = chunked_divergence(*student, *teacher, beta=0.5, norm=norm, token_chunk=1000, vocab_chunk=1000)
    assert _rel(div, ref_div) < EXACT
    div.sum().backward()
    for p, grad in zip((student[0], student[1], norm.weight), expected, strict=True):
        assert _rel(p.grad, grad) < EXACT


def test_masked_rows_get_no_gradient_and_no_row_is_an_empty_loss():
    student, teacher, rows, (norm, _), _ = _inputs(seed=2)
    div, _ = chunked_divergence(*student, *teacher, beta=0.5, rows=rows, norm=norm, **TILES)
    div.sum().backward()
    masked = torch.ones(M, dtype=torch.bool)
    masked[rows] = False
    assert torch.all(student[0].grad[masked] == 0) and torch.all(student[0].grad[~masked].abs().sum(1) > 0)
    empty, _ = chunked_divergence(*student, *teacher, beta=1.0, rows=rows[:0], norm=norm, **TILES)
    assert empty.shape == (0,) and empty.sum().item() == 0.0
    empty.sum().backward()  # a graph with nothing in it: zero gradients, no error


def test_no_tensor_spans_the_scored_rows_and_the_vocabulary():
    """With tiles of 5 x 7 no tensor has more than 7 entries along two dimensions (rows x vocabulary)."""
    student, teacher, rows, (norm, teacher_norm), upstream = _inputs(seed=3)
    recorder = ShapeRecorder()
    with recorder:
        div, _ = chunked_divergence(
            *student, *teacher, beta=0.5, rows=rows, norm=norm, teacher_norm=teacher_norm, **TILES
        )
        (div * upstream).sum().backward()
    big = [(op, s) for op, s in recorder.shapes if sum(d > 9 for d in s) >= 2]
    assert big == [] and any(s == (5, 7) for _, s in recorder.shapes)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"beta": 1.5}, "beta must be in \\[0, 1\\]"),
        ({"token_chunk": 0}, "Tile sizes must be positive"),
        ({"teacher_vocab": V + 1}, "shared vocabulary"),
        ({"teacher_rows": M - 1}, "same positions"),
    ],
)
def test_bad_inputs(change, match):
    student, teacher, rows, _, _ = _inputs()
    ht, wt, bt = teacher
    if "teacher_vocab" in change:
        wt, bt = torch.randn(change.pop("teacher_vocab"), HT, dtype=torch.float64), None
    if "teacher_rows" in change:
        ht = ht[: change.pop("teacher_rows")]
    options = {"beta": 0.5, **change}
    with pytest.raises(ValueError, match=match):
        chunked_divergence(*student, ht, wt, bt, rows=rows, **options)


def test_create_graph_is_refused():
    student, teacher, rows, _, _ = _inputs()
    div, _ = chunked_divergence(*student, *teacher, beta=0.5, rows=rows, **TILES)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(div.sum(), student[0], create_graph=True)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_trl_kernel_in_float32_and_under_bf16_autocast(autocast, beta):
    """TRL's ChunkedDivergenceFunction on the same (final) hidden states: both round the matmul operands to the
    autocast dtype and keep the logits in float32, so they agree to float32 rounding."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    student, teacher, rows, _, upstream = _inputs(seed=4)
    student = [None if t is None else t.detach().float().requires_grad_() for t in student]
    teacher = [None if t is None else t.detach().float() for t in teacher]
    results = []
    for kernel in ("trl", "ours"):
        for p in student:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if kernel == "trl":
                div, ent = ChunkedDivergenceFunction.apply(
                    student[0][rows], *student[1:], teacher[0][rows], *teacher[1:], beta, 0.8
                )
            else:
                div, ent = chunked_divergence(*student, *teacher, beta=beta, rows=rows, temperature=0.8, **TILES)
        (div * upstream.float()).sum().backward()
        results.append((div.detach(), ent, [p.grad.clone() for p in student]))
    (ref_div, ref_ent, ref_grads), (div, ent, grads) = results
    assert _rel(div, ref_div) < 1e-5 and _rel(ent, ref_ent) < 1e-5
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert _rel(grad, ref) < 1e-5
