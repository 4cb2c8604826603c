"""One simulated CUDA training step (``../shared/cudasim``) of any named shape, with or without LoRA; one JSON line.

The simulator's own ``sim.py`` builds Qwen3 shapes only. This runner builds any shape of
:data:`streambp_trl.sizing.shapes.NAMED_MODELS` (the Qwen3.5 hybrids included) on the meta device, makes its
parameters FakeTensors on ``cuda``, optionally wraps it in rank-16 LoRA on every linear layer of the decoder (PEFT),
allocates the trainable parameters' gradients (``--grads-ready``: every step after the first holds them) and runs one
forward+backward under the simulator's byte tracker, SDPA dispatch and oracle. The peak is
``torch.cuda.max_memory_allocated`` of an sm80+ GPU before fragmentation and the CUDA context.

Modes as the simulator's: ``gc`` (Hugging Face checkpointing, the model's loss over full logits), ``gc+fused``
(checkpointing + TRL's fused LM head: TRL 1.16's default), ``streambp`` (``enable_streambp`` + ``fused_lm_head``).
Without an fla / causal-conv1d install the Gated DeltaNet layers run transformers' torch fallback, whose buffers are
what is measured (the CUDA kernels hold fewer). Usage::

    python scripts/sim.py step --model qwen3.5-9b --lora --mode streambp --seq-len 65536 --chunk 2048 --grads-ready
    python scripts/sim.py step --model qwen3-8b --mode streambp --rows 4 --seq-len 8192 \
        --config '{"num_hidden_layers": 2, "layer_types": ["sliding_attention", "sliding_attention"]}'

``--model`` also takes a local config directory (``benchmarks/sim_configs/``: Qwen3.5-MoE's widths in 4 layers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .common import CUDASIM

sys.path.insert(0, str(CUDASIM))
import fakecuda  # noqa: E402, F401  (before torch)
import sim  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

GiB = 2**30
LORA_TARGETS = "all-linear"


def attention_choice(config) -> dict:
    """``attn_implementation="sdpa"`` where the model class supports it; nothing (its default) where it does not,
    which transformers would refuse (FalconMamba, Mamba: no attention)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return {"attn_implementation": "sdpa"} if getattr(model_cls, "_supports_sdpa", False) else {}


def build(name: str, dtype: torch.dtype, fake: FakeTensorMode, lora: bool, overrides: dict | None = None):
    from transformers import AutoModelForCausalLM

    from streambp_trl.bench.models import build_config

    config = build_config(name)
    for key, value in (overrides or {}).items():  # e.g. a smaller layer count or width (tests' tiny shapes)
        if not hasattr(config, key):
            raise ValueError(f"--config: {name}'s config has no field {key!r}")
        setattr(config, key, value)
    config.max_position_embeddings = 1 << 20
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attention_choice(config))
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.device("meta"):
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    fake.allow_non_fake_inputs = True
    with fake:
        model.to_empty(device="cuda")
        # to_empty gives each module its own new tensor, so a tied input/output embedding (one Parameter in two
        # modules) would come back as two: tie them again, as a loaded model has them
        (model.get_base_model() if hasattr(model, "get_base_model") else model).tie_weights()
    fake.allow_non_fake_inputs = False
    return model.train()


def prepare(model, mode: str, chunk: int, stream_kwargs: dict):
    if mode in ("gc", "gc+fused"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "gc+fused":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if mode == "streambp":
        from streambp_trl import enable_streambp

        enable_streambp(model, stream_chunk_size=chunk, logits_chunk_size=chunk, verify=False, **stream_kwargs)

    def loss_fn(ids):
        if mode in ("gc+fused", "streambp"):
            return -model(input_ids=ids, labels=ids, fused_lm_head=True, use_cache=False).log_probs.sum() / ids.numel()
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return loss_fn


def simulate(a: argparse.Namespace) -> dict:
    fake = FakeTensorMode()
    sim.real_causal_bias()
    sim.untrace_transformers()
    sim.stub_trl_triton()
    import torch.utils.checkpoint as cp

    cp.get_device_states = lambda *args: ([], [])
    # the simulated GPU is sm80+ (the peak above): transformers' grouped experts ask for the capability, which a
    # CPU build cannot read
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    dtype = getattr(torch, a.dtype)
    model = build(a.model, dtype, fake, a.lora, a.config)
    loss_fn = prepare(model, a.mode, a.chunk, a.stream_kwargs or {})
    with fake:
        ids = torch.empty(a.rows, a.seq_len, dtype=torch.long, device="cuda")
        if a.grads_ready:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
    tracker, sdpa = sim.LiveBytes(), sim.CudaSdpa()
    for t in [*model.parameters(), *model.buffers(), ids]:
        tracker.track(t, "model")
    model_bytes = tracker.current.get("cuda", 0)
    for p in model.parameters():
        if p.grad is not None:
            tracker.track(p.grad, "grads")
    start = time.perf_counter()
    with fake, sdpa, tracker, sim.Oracle():
        loss_fn(ids).backward()
    peak = tracker.peak.get("cuda", 0)
    return dict(
        model=a.model,
        config=a.config,
        lora=a.lora,
        dtype=a.dtype,
        mode=a.mode,
        seq_len=a.seq_len,
        rows=a.rows,
        chunk=a.chunk if a.mode == "streambp" else None,
        stream_kwargs=a.stream_kwargs or None,
        grads_ready=a.grads_ready,
        peak_gib=peak / GiB,
        model_gib=model_bytes / GiB,
        at_peak=tracker.at_peak.get("cuda"),
        sdpa=sdpa.counts,
        host_peak_gib=tracker.peak.get("cpu", 0) / GiB,
        wall_s=round(time.perf_counter() - start, 1),
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a named shape (streambp_trl.sizing.shapes.NAMED_MODELS)")
    p.add_argument("--mode", required=True, choices=["gc", "gc+fused", "streambp"])
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--rows", type=int, default=1, help="sequences in the batch (each --seq-len tokens)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--lora", action="store_true", help="rank-16 LoRA on every linear layer (PEFT, all-linear)")
    p.add_argument("--grads-ready", action="store_true", help="trainable parameters' gradients allocated first")
    p.add_argument("--config", type=json.loads, default=None, help="config fields to override (JSON)")
    p.add_argument("--stream-kwargs", type=json.loads, default=None, help="extra enable_streambp arguments (JSON)")
    print(json.dumps(simulate(p.parse_args(argv))), flush=True)
