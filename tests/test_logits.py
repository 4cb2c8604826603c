"""The chunked logit kernel against plain log_softmax (float64) and against TRL's fused LM head (float32)."""

import copy

import pytest
import torch
from models import batch, tiny_model
from trl.trainer.utils import add_fused_lm_head

from streambp_trl import chunked_logprobs, enable_streambp
from streambp_trl.logits import STAT_OUTPUTS


def _plain(h, w, b, t, temperature, softcap, scale):
    y = (h @ w.t() + (0 if b is None else b)) * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    z = y / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    first_max = z.argmax(-1)
    return {
        "log_probs": logp.gather(1, t[:, None])[:, 0],
        "entropy": -(p * logp).sum(-1),
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        "mean_logits": z.mean(-1),
        "is_top1": first_max == t,
    }


FORMS = {
    "fused": {},
    "two-node": {"form": "two-node"},
    "eager": {"form": "eager"},  # the loss below weights rows unequally: the eager node recomputes
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", [(3, 7), (64, 1000), (1, 1)])
def test_kernel_matches_log_softmax_float64(tiles, bias, softcap, form):
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 19, 12, 37
    h = torch.randn(n, hdim, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(vocab, hdim, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[3] = int(torch.argmax(h[3].detach() @ w.detach().t()))  # at least one top-1 hit
    kw = dict(temperature=0.7, softcap=softcap, scale=1.3)
    ref = _plain(h, w, b, t, **kw)
    ours = chunked_logprobs(
        h,
        w,
        b,
        t,
        temperature=0.7,
        softcap=softcap,
        logit_scale=1.3,
        token_chunk=tiles[0],
        vocab_chunk=tiles[1],
        outputs=STAT_OUTPUTS,
        **FORMS[form],
    )
    for name in STAT_OUTPUTS:
        if name == "is_top1":
            assert torch.equal(ours[name], ref[name]) and ours[name].any()
        else:
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-12, atol=1e-12)
    # a loss with both differentiable outputs, weighted per token
    wts = torch.randn(n, dtype=torch.float64, generator=g)
    params = [h, w] + ([b] if bias else [])
    ref_grads = torch.autograd.grad((ref["log_probs"] * wts).sum() + 0.3 * ref["entropy"].sum(), params)
    our_grads = torch.autograd.grad((ours["log_probs"] * wts).sum() + 0.3 * ours["entropy"].sum(), params)
    for r, o in zip(ref_grads, our_grads, strict=True):
        assert ((r - o).norm() / r.norm()).item() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_two_node_backward_agree(dtype):
    """The fused backward (one logit recompute) and the two-node one sum the same products in the same order: equal
    gradients for the hidden states, the weight, the bias and the final norm, scored rows a subset."""
    g = torch.Generator().manual_seed(2)
    m, hdim, vocab = 23, 16, 41
    norm = torch.nn.RMSNorm(hdim, dtype=dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2, generator=g)
    h = torch.randn(m, hdim, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, hdim, generator=g).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_()
    rows = torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 21, 22])
    t = torch.randint(0, vocab, (rows.numel(),), generator=g)
    wts = torch.randn(rows.numel(), generator=g)
    grads = []
    for fused in (True, False):
        out = chunked_logprobs(
            h,
            w,
            b,
            t,
            rows=rows,
            norm=norm,
            outputs=("log_probs", "entropy"),
            token_chunk=4,
            vocab_chunk=16,
            form="fused" if fused else "two-node",
        )
        loss = (out["log_probs"].float() * wts).sum() + 0.5 * out["entropy"].float().sum()
        grads.append(torch.autograd.grad(loss, [h, w, b, norm.weight]))
    for fused_grad, two_node_grad in zip(*grads, strict=True):
        assert fused_grad.dtype == two_node_grad.dtype == dtype
        assert torch.equal(fused_grad, two_node_grad)


@pytest.mark.parametrize("scored", ["all", "some"])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_gradient_in_forward_float64(softcap, scored, monkeypatch):
    """A token-mean loss (the same weight on every row, no entropy gradient): the gradient formed in the forward, with
    no recompute in backward, equals plain autograd's for the hidden states, the weight, the bias and the final norm
    (all rows, or some rows, scored). A loss that weights rows unequally takes the recompute and is exact too."""
    from streambp_trl.logits import eager, nodes

    g = torch.Generator().manual_seed(3)
    m, hdim, vocab = 17, 8, 29
    norm = torch.nn.RMSNorm(hdim, dtype=torch.float64)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2, generator=g)
    h = torch.randn(m, hdim, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(vocab, hdim, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True)
    rows = None if scored == "all" else torch.tensor([1, 2, 4, 7, 8, 11, 15, 16])
    n = m if rows is None else rows.numel()
    t = torch.randint(0, vocab, (n,), generator=g)
    params = [h, w, b, norm.weight]
    y = norm(h if rows is None else h[rows]) @ w.t() + b
    y = y * 1.3 if softcap is None else softcap * torch.tanh(y * 1.3 / softcap)
    ref_logp = torch.log_softmax(y / 0.7, -1).gather(1, t[:, None])[:, 0]
    monkeypatch.setattr(eager, "EAGER_TILE_ELEMENTS", 3 * vocab)  # tiles of 3 rows
    recomputed = []
    original = nodes.LogitNode._backward
    monkeypatch.setattr(nodes.LogitNode, "_backward", lambda *a: recomputed.append(1) or original(*a))
    for weights, recomputes in ((torch.full((n,), -1 / n, dtype=torch.float64), 0), (torch.randn(n, generator=g), 1)):
        out = chunked_logprobs(
            h,
            w,
            b,
            t,
            rows=rows,
            norm=norm,
            temperature=0.7,
            softcap=softcap,
            logit_scale=1.3,
            outputs=("log_probs", "entropy"),
            form="eager",
        )
        torch.testing.assert_close(out["log_probs"], ref_logp, rtol=1e-12, atol=1e-12)
        ours = torch.autograd.grad((out["log_probs"] * weights).sum(), params)
        ref = torch.autograd.grad((ref_logp * weights).sum(), params, retain_graph=True)
        for r, o in zip(ref, ours, strict=True):
            assert ((r - o).norm() / r.norm()).item() < 1e-12
        assert len(recomputed) == recomputes
        recomputed.clear()


def test_kernel_without_entropy_gradient():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, generator=g)
    t = torch.randint(0, 9, (5,), generator=g)
    out = chunked_logprobs(h, w, None, t, outputs=("log_probs", "entropy"), token_chunk=2, vocab_chunk=4)
    (grad,) = torch.autograd.grad(out["log_probs"].sum(), [h])
    (ref,) = torch.autograd.grad(torch.log_softmax(h @ w.t(), -1).gather(1, t[:, None]).sum(), [h])
    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)


def test_kernel_rejects_bad_arguments():
    h, w, t = torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="Unknown outputs"):
        chunked_logprobs(h, w, None, t, outputs=("logits",))
    with pytest.raises(ValueError, match="positive"):
        chunked_logprobs(h, w, None, t, token_chunk=0)


FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("trl_first", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: final-logit softcapping
def test_fused_lm_head_matches_trl(family, trl_first):
    """Same FusedCausalLMOutput as TRL 1.16's fused head (whose statistics are float32), with temperature."""
    trl_model = tiny_model(family, dtype=torch.float32)
    ours = copy.deepcopy(trl_model)
    add_fused_lm_head(trl_model, temperature=0.8, outputs=FIELDS)
    if trl_first:
        add_fused_lm_head(ours, temperature=0.8, outputs=FIELDS)
    enable_streambp(ours, stream_chunk_size=5, logits_chunk_size=4, temperature=0.8, fused_outputs=FIELDS)
    ids, mask, labels = batch(padding="left")
    ref = trl_model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert torch.equal(out.label_mask, ref.label_mask)
    for name in FIELDS:
        if name == "is_top1":
            assert torch.equal(out.is_top1, ref.is_top1)
        else:
            torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-5)
    (ref.loss + 0.1 * ref.entropy.sum()).backward()
    (out.loss + 0.1 * out.entropy.sum()).backward()
    theirs = dict(trl_model.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name].grad
        assert ((p.grad - q).norm() / q.norm()).item() < 1e-5, name


def test_fused_path_is_ours_in_float64():
    """TRL's kernel keeps float32 statistics; ours keeps float64, so the float64 log-probs are exact."""
    model = tiny_model("llama")
    add_fused_lm_head(model)
    enable_streambp(model, stream_chunk_size=4)
    ids, mask, labels = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    ref = torch.log_softmax(logits[:, :-1], -1).gather(2, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    ref = ref.masked_fill(labels[:, 1:] == -100, 0)
    torch.testing.assert_close(out.log_probs.detach(), ref, rtol=1e-13, atol=1e-13)


def test_addmm_acc_casts_a_slice_at_a_time(monkeypatch):
    """Off CUDA a half-precision product accumulates in float32 a slice of the contracted dimension at a time: the
    sum over several slices equals the float64 product (to float32 rounding), and no whole operand is cast."""
    from streambp_trl.logits import tiles

    monkeypatch.setattr(tiles, "_CAST_SLICE_ELEMENTS", 64 * 16)  # 16 of 100 contracted columns per slice: 7 slices
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 100, generator=g).bfloat16()
    b = torch.randn(100, 64, generator=g).bfloat16()
    acc = torch.randn(48, 64, generator=g)
    want = acc.double() + a.double() @ b.double()
    casts = []
    to = torch.Tensor.to

    def counted(t, *args, **kwargs):
        casts.append(t.numel())
        return to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted)
    tiles.addmm_acc(acc, a, b)
    monkeypatch.undo()
    assert ((acc.double() - want).norm() / want.norm()).item() < 1e-6
    assert len(casts) == 14 and max(casts) <= 16 * 64
