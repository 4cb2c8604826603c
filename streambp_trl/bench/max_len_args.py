"""The arguments of ``streambp-trl max-len`` (:mod:`.max_len`): the model, the objective and the recipe, the card or
the memory, the plan's fixed choices, and the measured search's range."""

from __future__ import annotations

import argparse

from streambp_trl.sizing import memory_model as mm

from .max_len_rows import CUDA_RESERVE_GIB, DEFAULT_GPU, DEFAULT_OPTIMIZER, GPUS, OPTIMIZER_CHOICES, ROWS, gpu_budget


def _size_arg(text: str) -> int:
    try:
        return mm.parse_size(text, unit_required=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """A command-line integer of at least 1 (argparse's ``type``)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streambp-trl max-len",
        description="The longest sequence one training step fits, per mode: measured on a GPU (or on the CPU "
        "against --budget), or estimated from the memory model (no GPU, or --gpu-memory).",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a named shape (qwen3-8b, 8b, qwen3.5-9b, ...) or its Hub name (Qwen/Qwen3-8B), another Hub id "
        "(org/name: its config), or a local directory",
    )
    p.add_argument("--objective", choices=mm.OBJECTIVES, default="sft")
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="estimate each sequence split across this many GPUs (sequence parallelism: configs/accelerate/"
        "zero3_sp.yaml), the weights, gradients and optimizer state sharded across them by ZeRO-3; stream rows only, "
        "lengths of the whole sequence, memory per GPU (estimates only)",
    )
    p.add_argument(
        "--lora", "--use-peft", "--use_peft", action="store_true", help="LoRA (r 16, all linear layers) instead of "
        "full fine-tuning (the adapters float32, as PEFT keeps them beside a bfloat16 base)"
    )  # fmt: skip
    quant = p.add_mutually_exclusive_group()
    quant.add_argument(
        "--load-in-4bit",
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: LoRA on base weights stored as bitsandbytes 4-bit (NF4/FP4: 0.5 byte a weight and a float32 "
        "absmax per 64), the embedding and LM head in the compute dtype, the adapters bfloat16 (TRL's cast); "
        "estimates only",
    )
    quant.add_argument(
        "--load-in-8bit", "--load_in_8bit", action="store_true", help="LoRA on LLM.int8 base weights; estimates only"
    )
    p.add_argument(
        "--use-bnb-nested-quant",
        "--use_bnb_nested_quant",
        action="store_true",
        help="with --load-in-4bit: double quantization (the absmax in a byte per 64 weights)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="measured runs: add the stream + offload row (trials up to a million tokens, needs host memory); "
        "an estimate always has it",
    )
    card = p.add_mutually_exclusive_group()
    card.add_argument(
        "--gpu",
        choices=GPUS,
        help=f"estimate for this card: its stated memory (GiB) less {CUDA_RESERVE_GIB} GiB for the CUDA context: "
        + ", ".join(f"{name} {gpu_budget(name)}" for name in GPUS)
        + f" (default without a GPU: {DEFAULT_GPU})",
    )
    card.add_argument(
        "--gpu-memory",
        type=_size_arg,
        help="estimate for this much memory, what the step may use (not the card's size: see --gpu), e.g. 78GiB",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to measure")
    p.add_argument("--budget", type=_size_arg, help="measured runs: the most the peak may reach (cpu: required)")
    p.add_argument("--chunk", type=positive_int, help="stream_chunk_size (default: auto, as the trainers)")
    p.add_argument(
        "--logits-chunk",
        type=positive_int,
        help="measured runs: logits_chunk_size (default: the chunk; an estimate plans it as the chunk, as the engine)",
    )
    p.add_argument(
        "--keep-every",
        type=positive_int,
        help="stream rows: keep only every k-th layer's input (default: chosen by the plan in an estimate, 1 in a "
        "measured row)",
    )
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        help='an estimate\'s plans: the lengths to show what "auto" would plan (default: 16,384 doubled up to the '
        "longest any plan fits)",
    )
    p.add_argument(
        "--host-memory",
        type=_size_arg,
        help="an estimate's offload row and plans: host memory offload may pin (default: 3/4 of this machine's "
        "available memory, as the engine allows itself; the output states it)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 (float32 on the CPU)")
    p.add_argument(
        "--optimizer",
        "--optim",
        choices=OPTIMIZER_CHOICES,
        default=DEFAULT_OPTIMIZER,
        metavar="OPTIM",
        help=f"the optimizer whose state the step holds, by TrainingArguments' optim name (default "
        f"{DEFAULT_OPTIMIZER}, TRL's: for full fine-tuning the state of every weight, for LoRA the adapters'), in the "
        "trained parameters' dtype where it follows it (AdamW: 2 moments of it); none: the forward+backward alone. "
        f"One of: {', '.join(OPTIMIZER_CHOICES)}",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="the optimizer state in host memory (DeepSpeed's offload_optimizer, configs/accelerate/zero3_offload.yaml"
        "): none of it on the GPU (the weights and gradients counted there all the same: an upper bound under ZeRO-3, "
        "which also offloads the weights)",
    )
    p.add_argument(
        "--gradient-accumulation-steps",
        type=positive_int,
        default=1,
        help="an estimate's stream rows: 1, each step's backward forms the parameter gradients (the trainer frees "
        "them after each optimizer step); more, a micro-step after the first holds them through its whole step",
    )
    p.add_argument("--mode", nargs="+", choices=ROWS, help="only these rows")
    p.add_argument("--step", type=positive_int, default=1024, help="lengths are multiples of this")
    p.add_argument("--limit", type=positive_int, default=1 << 22, help="measured runs: longest length tried")
    p.add_argument("--timeout", type=float, help="measured runs: seconds allowed per trial")
    p.add_argument("--json", metavar="FILE", help="also write the result (rows, trials) as JSON")
    return p
