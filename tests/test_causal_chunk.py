"""A plainly causal chunk on the CPU: prefix and diagonal block as two flash calls merged by their log-sum-exps
(streambp_trl.attention.causal_chunk, its CPU kernel), against SDPA with PyTorch's bottom-right causal bias."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from streambp_trl.attention import causal_chunk
from streambp_trl.attention.causal_chunk import CPU_FLASH, CausalChunkAttention, LseKernel, deterministic_only


@pytest.mark.parametrize("prefix", [0, 1, 12])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_matches_bottom_right_causal_sdpa(prefix, kv_heads, scale, align):
    """``align`` 4 and 16 pad the 7 queries (and the diagonal block's keys/values) to 8 and 16."""
    torch.manual_seed(0)
    chunk = 7
    q = torch.randn(2, 4, chunk, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, prefix + chunk, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, prefix + chunk, 16, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, chunk, 16, dtype=torch.float64)
    reference = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(chunk, prefix + chunk), scale=scale, enable_gqa=kv_heads < 4
    )
    out = CausalChunkAttention.apply(q, k, v, scale, CPU_FLASH, align)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(reference, (q, k, v), dout), strict=True
    ):
        assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_no_mask_is_built_for_a_causal_chunk():
    """The bottom-right bias materialises the chunk's mask (tril); the split runs no such operation."""
    q = torch.randn(1, 2, 8, 16)
    k, v = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    with torch.profiler.profile() as prof:
        CausalChunkAttention.apply(q, k, v, None)
    names = {e.name for e in prof.events()}
    assert "aten::tril" not in names and "aten::where" not in names
    with torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(8, 24))
    assert "aten::tril" in {e.name for e in prof.events()}  # the check can fail


def test_deterministic_algorithms_rule_out_cudnn():
    """As PyTorch's SDPA: cuDNN's attention backward is not deterministic, so it is not chosen while deterministic
    algorithms are required (``warn_only`` allows it)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not deterministic_only()
        torch.use_deterministic_algorithms(True)
        assert deterministic_only()
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not deterministic_only()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_the_cudnn_check_compares_with_the_math_kernel(monkeypatch):
    """The one-time check of cuDNN's form (here with the CPU's flash kernel in cuDNN's place): passes for a kernel
    that computes the form, whatever the caller's mode (inference mode, no grad); fails, with a warning, for one
    whose log-sum-exps are off (a kernel reporting them in another base would be) and for one that raises."""
    check = causal_chunk._cudnn_check.__wrapped__
    cpu = torch.device("cpu")
    monkeypatch.setattr(causal_chunk, "CUDNN", CPU_FLASH)
    with torch.inference_mode(), torch.no_grad():
        assert check(cpu, torch.bfloat16, 32)

    def off_lse(query, key, value, causal, scale):
        out, lse, extra = CPU_FLASH.forward(query, key, value, causal, scale)
        return out, lse * 1.4427, extra  # log2-based

    monkeypatch.setattr(causal_chunk, "CUDNN", LseKernel("off", off_lse, CPU_FLASH.backward))
    with pytest.warns(UserWarning, match="differs from the reference"):
        assert not check(cpu, torch.bfloat16, 32)

    def raising(*args):
        raise RuntimeError("cuDNN Frontend error: no engine\nmore")

    monkeypatch.setattr(causal_chunk, "CUDNN", LseKernel("raising", raising, raising))
    with pytest.warns(UserWarning, match="cuDNN attention unavailable .cuDNN Frontend error: no engine.;"):
        assert not check(cpu, torch.bfloat16, 32)
