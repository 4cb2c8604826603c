"""Run the stream engine on fake CUDA tensors (``../shared/cudasim``) and report which SDPA kernels it used.

A script, run in a subprocess by ``tests/test_cuda_paths.py``: the simulator's ``fakecuda`` must be imported before
torch (it loads a small compiled library that registers a fake CUDA device guard), which the pytest process has
long done. Usage::

    python tests/cuda_sim_run.py CUDASIM_DIR CASE [CASE ...]      # one JSON line per case on stdout
    python tests/cuda_sim_run.py CUDASIM_DIR --attention-layer [PREFIX CHUNK]  # one chunk's attention backward

Each case is a forward + backward of ``enable_streambp(model, stream_chunk_size=..., verify=False)`` on a tiny model
whose parameters and activations are FakeTensors on device ``cuda`` (no data), with the simulator's ``CudaSdpa``
counting the kernels SDPA would take on an sm80+ GPU (``flash`` > ``efficient`` > ``math``). The JSON line has the
counts, and the error (type and first line) if the step raised, e.g. ``FakeTensorDeviceMismatchError`` when a CPU
tensor is mixed into CUDA work.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

sys.path.insert(0, sys.argv[1])
import fakecuda  # noqa: E402, F401  (before torch)
import sim  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from model_support import streamed_here  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from transformers.masking_utils import causal_mask_function  # noqa: E402
from zoo import tiny_config  # noqa: E402

from streambp_trl import enable_streambp  # noqa: E402
from streambp_trl.attention import causal_chunk, cuda, kernels, masks  # noqa: E402

_SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    attention_dropout=0.0,
)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 48}),
    "qwen2-sliding": (
        transformers.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1, "layer_types": None},
    ),
    "doge": (transformers.DogeConfig, {"keep_window_size": 48}),  # a dynamic mask: a per-head bias with gradient
}

# families built from the sweep's tiny configs (tests/zoo): the model-specific attention paths
ZOO_FAMILIES = {
    "gemma4_text",  # keys/values shared across layers (the last two layers reuse the first two's)
    "gemma3n_text",  # shared keys/values and AltUp's stacked streams
    "inkling2_text",  # a relative-position bias and a sink per query, both with gradient
    "zaya",  # a second per-token stream (the routers' hidden states) and a mapping of masks
    "blt",  # byte and patch stacks, with whole-sequence cross-attention between them (not streamed)
    "deepseek_v4",  # compressed attention: window buffers, overlaps and compressed entries carried, an indexer
}

# name: (family, dtype, config overrides, batch, right padding, patch)
CASES = {
    "causal-gqa-bf16": ("qwen3", "bfloat16", {}, 1, 0, None),
    "causal-mha-bf16": ("qwen3", "bfloat16", {"num_key_value_heads": 8}, 1, 0, None),
    "causal-mqa-bf16": ("qwen3", "bfloat16", {"num_key_value_heads": 1}, 1, 0, None),
    "causal-gqa-fp32": ("qwen3", "float32", {}, 1, 0, None),
    "causal-mha-fp32": ("qwen3", "float32", {"num_key_value_heads": 8}, 1, 0, None),
    "padded-gqa-bf16": ("qwen3", "bfloat16", {}, 2, 37, None),
    "padded-mha-bf16": ("qwen3", "bfloat16", {"num_key_value_heads": 8}, 2, 37, None),
    "sliding-gqa-bf16": ("mistral", "bfloat16", {}, 1, 0, None),
    "sliding-mha-fp32": ("mistral", "float32", {"num_key_value_heads": 8}, 1, 0, None),
    "sliding-layers-bf16": ("qwen2-sliding", "bfloat16", {}, 1, 0, None),
    "head-dim-512-bf16": ("qwen3", "bfloat16", {"head_dim": 512}, 1, 0, None),
    "float64": ("qwen3", "float64", {}, 1, 0, None),
    "dynamic-mask-gqa-bf16": ("doge", "bfloat16", {}, 1, 0, None),
    "dynamic-mask-mha-fp32": ("doge", "float32", {"num_key_value_heads": 8}, 1, 0, None),
    "shared-kv-bf16": ("gemma4_text", "bfloat16", {}, 2, 37, None),
    # (no activation sparsity: its cutoff is a tensor made from a Python float, which the simulator cannot fake in
    # the autograd thread that runs a recompute)
    "altup-shared-kv-bf16": ("gemma3n_text", "bfloat16", {"activation_sparsity_pattern": [0.0] * 3}, 2, 37, None),
    "position-bias-bf16": ("inkling2_text", "bfloat16", {}, 2, 37, None),
    "router-stream-bf16": ("zaya", "bfloat16", {}, 2, 37, None),
    # (static patches: entropy patching's boundaries are data-dependent shapes, which fake tensors cannot compute)
    "byte-patch-bf16": ("blt", "bfloat16", {"patching_mode": "static"}, 2, 37, None),
    "compressed-bf16": (
        "deepseek_v4",
        "bfloat16",
        # (top-k routed experts: hash routing reads the token ids' values, which fake tensors do not have)
        {
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "index_topk": 4,
            "mlp_layer_types": ["moe", "moe"],
        },
        2,
        37,
        None,
    ),
    # cuDNN's form (its check and compute capability 9.0+ assumed; the simulator has no cuDNN): chunks of 64 after
    # prefixes that are multiples of 64, the last chunk (32) padded to 64
    "cudnn-gqa-bf16": ("qwen3", "bfloat16", {}, 1, 0, "cudnn"),
    "cudnn-mha-bf16": ("qwen3", "bfloat16", {"num_key_value_heads": 8}, 1, 0, "cudnn"),
    "cudnn-padded-bf16": ("qwen3", "bfloat16", {}, 2, 37, "cudnn"),  # a mask block: memory-efficient
    # deliberately broken engines: the simulation must catch them
    "bug-cpu-mask": ("mistral", "bfloat16", {}, 1, 0, "cpu_mask"),
    "bug-math-attention": ("qwen3", "float32", {}, 1, 0, "math_attention"),
}
# a family the installed transformers has changed so that the engine refuses it runs no case
CASES = {name: case for name, case in CASES.items() if case[0] not in ZOO_FAMILIES or streamed_here(case[0])}
SEQ_LEN, CHUNK = 160, 64


class PaddingOracle(sim.Oracle):
    """The simulator's Oracle answers every data-dependent boolean question True, which would call a padded mask
    'all ones' and drop it: here any question about a tensor computed from the attention mask is answered False
    (the padded mask does have zeros), everything else as the Oracle does."""

    def __init__(self, padding: torch.Tensor | None):
        super().__init__()
        self.tainted: dict[int, weakref.ref] = {}  # by identity (a WeakSet would compare tensors with ==)
        if padding is not None:
            self.taint(padding)

    def taint(self, t: torch.Tensor) -> None:
        self.tainted[id(t)] = weakref.ref(t)

    def is_tainted(self, t: torch.Tensor) -> bool:
        ref = self.tainted.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and self.is_tainted(args[0]):
            return False
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if any(self.is_tainted(t) for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.taint(t)
        return out


def _cpu_additive_mask(block, dtype):  # BUG: the additive mask is allocated without device=
    mask = torch.zeros(block.shape, dtype=dtype)
    return mask.masked_fill_(block.logical_not(), float("-inf"))


def _math_attention(module, query, key, value, block, sinks, scaling, dropout, prefix):  # BUG: lets SDPA choose
    """The CPU path on CUDA (this module's code before it picked kernels): grouped heads with
    ``enable_gqa=True`` and float32 leave SDPA nothing but math."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if block is not None:
        return sdpa_attention_forward(module, query, key, value, block, scaling=scaling, dropout=dropout)[0]
    mask = masks.LowerRight(query.shape[2], key.shape[2])
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, mask, dropout, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


CUDNN_CALLS = {"forward": 0, "backward": 0, "padded": 0}


def _counted(kind: str, fn):
    def counted(*args, **kwargs):
        CUDNN_CALLS[kind] += 1
        return fn(*args, **kwargs)

    return counted


def _force_cudnn() -> list[tuple]:
    """cuDNN's form taken as on an sm90 GPU (its check assumed passed; its ops run on their meta functions), chunk
    lengths padded to multiples of 64; its kernel calls counted. Returns what to restore."""
    saved = [(cuda, name, getattr(cuda, name)) for name in ("cudnn_usable", "CUDNN_ALIGN", "CUDNN")]
    chunk_attention = causal_chunk.CausalChunkAttention.apply

    def counted_chunk(query, key, value, scale, kernel, align):
        CUDNN_CALLS["padded"] += query.shape[2] % align != 0
        return chunk_attention(query, key, value, scale, kernel, align)

    saved.append((causal_chunk.CausalChunkAttention, "apply", chunk_attention))
    cuda.cudnn_usable = lambda device, dtype, head_dim: True
    cuda.CUDNN_ALIGN = 64
    cuda.CUDNN = causal_chunk.LseKernel(
        "cudnn", _counted("forward", causal_chunk.CUDNN.forward), _counted("backward", causal_chunk.CUDNN.backward)
    )
    causal_chunk.CausalChunkAttention.apply = counted_chunk
    return saved


PATCHES = {
    "cpu_mask": (cuda, "_additive_mask", _cpu_additive_mask),
    "math_attention": (cuda, "cuda_attention", _math_attention),
    "cudnn": _force_cudnn,
}


def build(family: str, dtype: torch.dtype, overrides: dict, fake: FakeTensorMode):
    if family in ZOO_FAMILIES:  # the sweep's tiny config of a model type, with its own attention implementation
        config = tiny_config(family, **overrides)
    else:
        config_cls, extra = FAMILIES[family]
        config = config_cls(**{**_SMALL, **extra, **overrides})
        config._attn_implementation = "sdpa"
    with torch.device("meta"):  # (eager experts: the grouped kernel's check asks the real CUDA runtime)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    fake.allow_non_fake_inputs = True
    with fake:
        model.to_empty(device="cuda")
    fake.allow_non_fake_inputs = False
    return model.train()


def run_case(name: str) -> dict:
    family, dtype, overrides, batch, pad, patch = CASES[name]
    fake = FakeTensorMode()
    model = build(family, getattr(torch, dtype), overrides, fake)
    enable_streambp(model, stream_chunk_size=CHUNK, verify=False)
    saved = []
    if patch == "cudnn":
        saved = _force_cudnn()
    elif patch:
        owner, attr, replacement = PATCHES[patch]
        saved = [(owner, attr, getattr(owner, attr))]
        setattr(owner, attr, replacement)
    CUDNN_CALLS.update(forward=0, backward=0, padded=0)
    sdpa, result = sim.CudaSdpa(), {"case": name}
    try:
        with fake:
            ids = torch.empty(batch, SEQ_LEN, dtype=torch.long, device="cuda")
            mask = torch.empty(batch, SEQ_LEN, dtype=torch.long, device="cuda") if pad else None
        with fake, sdpa, PaddingOracle(mask):
            out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
            out.loss.backward()
        grads = [p for p in model.parameters() if p.grad is not None]
        result["no_grad"] = [n for n, p in model.named_parameters() if p.grad is None]
        result["grads"] = len(grads)
        result["params"] = sum(p.requires_grad for p in model.parameters())
        result["grad_devices"] = sorted({p.grad.device.type for p in grads})
    except Exception as e:  # reported, not raised: the test decides what was expected
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
    result["sdpa"] = sdpa.counts
    result["cudnn"] = dict(CUDNN_CALLS)
    return result


def attention_layer(
    prefix: int = 32768, chunk: int = 4096, cudnn: int = 0, heads: int = 32, kv_heads: int = 8, d: int = 128
) -> dict:
    """Peak bytes above its inputs of one chunk's attention forward + backward on fake CUDA (Qwen3-8B's heads,
    bf16), with the keys/values as (prefix leaf, chunk) concatenated as the stream layer's recompute has them;
    ``cudnn`` 1: through cuDNN's form (:func:`_force_cudnn`)."""
    saved = _force_cudnn() if cudnn else []
    fake, tracker, sdpa = FakeTensorMode(), sim.LiveBytes(), sim.CudaSdpa()
    sim.real_causal_bias()
    module = torch.nn.Module()
    mask = masks.StreamMask(batch_size=1, mask_function=causal_mask_function).at(prefix, 0)
    with fake:
        q = torch.empty(1, heads, chunk, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        kp, vp, kc, vc = (
            torch.empty(1, kv_heads, n, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            for n in (prefix, prefix, chunk, chunk)
        )
        dy = torch.empty(1, chunk, heads, d, dtype=torch.bfloat16, device="cuda")
    for t in (q, kp, vp, kc, vc, dy):
        tracker.track(t, "inputs")
    base = tracker.current["cuda"]
    with fake, sdpa, tracker:
        k, v = torch.cat([kp, kc], dim=2), torch.cat([vp, vc], dim=2)
        out, _ = kernels.stream_attention(module, q, k, v, mask, scaling=d**-0.5)
        del k, v
        torch.autograd.grad(out, (q, kp, vp, kc, vc), dy)
    for owner, attr, value in reversed(saved):
        setattr(owner, attr, value)
    mib = 2**20
    return {
        "prefix": prefix,
        "chunk": chunk,
        "peak_above_inputs_mib": (tracker.peak["cuda"] - base) / mib,
        "at_peak": tracker.at_peak.get("cuda"),
        "sdpa": sdpa.counts,
        "cudnn": dict(CUDNN_CALLS),
    }


def main() -> None:
    sim.untrace_transformers()
    sim.real_causal_bias()
    sim.stub_trl_triton()
    import torch.utils.checkpoint as cp

    cp.get_device_states = lambda *args: ([], [])  # no CUDA RNG state to save (fake CUDA has none)
    if sys.argv[2] == "--attention-layer":
        print(json.dumps(attention_layer(*map(int, sys.argv[3:]))), flush=True)
        return
    for name in sys.argv[2:] if sys.argv[2:] != ["all"] else list(CASES):
        print(json.dumps(run_case(name)), flush=True)


if __name__ == "__main__":
    main()
    sys.stderr.flush()
    # Skip interpreter teardown: with the fake CUDA device, the autograd engine's device thread sometimes aborts
    # the process at exit ("terminate called without an active exception") after all output is written.
    os._exit(0)
