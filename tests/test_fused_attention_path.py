"""Float64 gradient parity of the CUDA attention path (explicit fused kernels, grouped-query heads one group at a time,
the prefix's key/value gradient added straight into the layer's sums), run on the CPU.

On a CUDA tensor the stream attention never calls SDPA's math kernel: it picks flash (or memory-efficient)
attention explicitly and runs grouped-query heads through ``_GroupedHeads``. PyTorch's CPU build has a flash
kernel too (float64 included), so routing CPU tensors through that path checks its numerics here against plain
autograd; ``tests/test_cuda_paths.py`` checks under the CUDA simulator that the path is taken on CUDA.
"""

import copy

import pytest
import torch
from helpers import max_rel_grad_error, reference_loss
from models import tiny_model
from transformers import AttentionInterface

from streambp_trl import enable_streambp
from streambp_trl.attention import causal_chunk, cuda, grouped, interface
from streambp_trl.attention.causal_chunk import CPU_FLASH

TOL = 1e-10


def _cuda_path_on_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """:func:`stream_attention` as it runs on CUDA, for CPU tensors (causal blocks: flash)."""
    block = attention_mask.block(query.shape[2], key.shape[2], query.device)
    assert block is None, "the CPU has no memory-efficient kernel: only plainly causal chunks here"
    prefix = grouped.PrefixGrad.of(attention_mask, key, value)
    return cuda.cuda_attention(module, query, key, value, block, None, scaling, dropout, prefix), None


@pytest.fixture(params=["flash", "cudnn"])
def cuda_path(monkeypatch, request):
    """``route()`` sends the ``"streambp"`` attention through the CUDA path (after ``enable_streambp``, whose probe
    batch is padded) with the flash kernel, or the cuDNN form (prefix and diagonal merged, several key/value heads
    per call, chunks padded to a multiple of ``align``) with the CPU's flash kernel in cuDNN's place; the grouped
    calls are counted (all, those with a prefix, and the key/value heads per call), and the padded cuDNN-form
    calls."""
    calls = {"grouped": 0, "prefix": 0, "per_call": set(), "kernel": request.param, "padded": 0}

    def route(align: int = 1):
        interface._register()
        monkeypatch.setitem(AttentionInterface._global_mapping, interface.IMPLEMENTATION, _cuda_path_on_cpu)
        monkeypatch.setattr(cuda, "_FLASH_DTYPES", (torch.float64,))  # CUDA's flash has no float64; the CPU's has
        if request.param == "cudnn":
            monkeypatch.setattr(cuda, "cudnn_usable", lambda device, dtype, head_dim: True)
            monkeypatch.setattr(cuda, "CUDNN", CPU_FLASH)
            monkeypatch.setattr(cuda, "CUDNN_ALIGN", align)
            chunk_attention = causal_chunk.CausalChunkAttention.apply

            def counted_chunk(query, key, value, scale, kernel, align):
                calls["padded"] += query.shape[2] % align != 0
                return chunk_attention(query, key, value, scale, kernel, align)

            monkeypatch.setattr(causal_chunk.CausalChunkAttention, "apply", counted_chunk)

    calls["route"] = route
    apply = grouped._GroupedHeads.apply

    def counted(query, key, value, attend, prefix, per_call=1):
        calls["grouped"] += 1
        calls["prefix"] += prefix is not None
        calls["per_call"].add(per_call)
        return apply(query, key, value, attend, prefix, per_call)

    monkeypatch.setattr(grouped._GroupedHeads, "apply", counted)
    return calls


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(4, 2), (8, 2), (16, 4), (4, 1), (4, 4)], ids=["gqa", "gqa4", "gqa4x4", "mqa", "mha"]
)
@pytest.mark.parametrize("chunk", [3, 7, 23])
def test_cuda_attention_path_is_exact(cuda_path, heads, kv_heads, chunk):
    reference = tiny_model("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk, logits_chunk_size=5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 101, (2, 23), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :4] = -100
    cuda_path["route"](align=chunk)  # the cuDNN form: a ragged last chunk padded to a multiple of the chunk
    ref_loss = reference_loss(reference, ids, mask, labels)
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"
    several_chunks = chunk < ids.shape[1]
    if cuda_path["kernel"] == "cudnn":  # a few key/value heads per call; the prefix's gradient into the sums
        per_call = cuda.cudnn_kv_heads(kv_heads, heads // kv_heads)
        assert (cuda_path["prefix"] > 0) == several_chunks
        assert cuda_path["per_call"] == ({per_call} if several_chunks or per_call < kv_heads else set())
        assert per_call == {(4, 2): 1, (8, 2): 2, (16, 4): 2, (4, 1): 1, (4, 4): 2}[heads, kv_heads]
        assert (cuda_path["padded"] > 0) == (ids.shape[1] % chunk != 0)  # a ragged last chunk, padded
    elif kv_heads == heads:  # one SDPA call over all heads; the prefix gradient goes back through autograd
        assert cuda_path["grouped"] == 0
    else:  # every recompute of a chunk after the first hands its prefix's key/value gradient to the sums directly
        assert (cuda_path["prefix"] > 0) == several_chunks
        assert cuda_path["grouped"] > 0 or kv_heads == 1
