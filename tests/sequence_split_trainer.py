"""Two SFT training steps with the sequence split across processes (DeepSpeed Ulysses, ``sp_size`` = the world; with
``--cp`` context parallelism under FSDP2, ``cp_size`` = the world), for tests/test_sequence_split.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/sequence_split_trainer.py \
        --trainer stream|trl [--cp] --out F

Set up as TRL documents sequence parallelism for SFT: accelerate's ``ParallelismConfig(sp_backend="deepspeed",
sp_size=N)`` in the config, DeepSpeed ZeRO-3 (tests/distributed_trainer.py's gloo state, as ``accelerate launch``
builds it on GPUs), ``pad_to_multiple_of`` the split. DeepSpeed's data path hands each rank its share of every row
with global ``position_ids`` and ``shift_labels``; the Trainer reduces the ranks' losses. ``--trainer stream`` is
StreamSFTTrainer (each rank streams its share, attention over the whole row through the engine's own key/value
exchange), ``trl`` TRL's SFTTrainer (DeepSpeed's Ulysses attention). ``--world-one`` runs StreamSFTTrainer in one
process without the split, on the same rows; ``--unsplit`` under ZeRO-3 without the split (each rank training a row
of its own, the same row: the same steps). ``--cp``: accelerate's FSDP2 on gloo with ``ParallelismConfig(cp_size=N)``
(GRPO and RLOO: in the environment, as ``accelerate launch`` with configs/accelerate/fsdp2_cp.yaml hands it over),
whose loader hands every rank the same batches.

The dataset is two copies of one chat row, so whichever rank's row a step takes, every step trains the same row:
one process's steps are the same steps. Rank 0 writes each step's logged loss (and, with ``--eval``, eval loss), the
weights after the steps (float64) and the (rank, ranks, tokens, with grad) of each decoder call the engine split to
``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LR = 1.0
ONLINE = ("grpo", "rloo")  # generated completions, rewarded by their length


def main() -> None:
    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective shows where, instead of hanging the suite
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("stream", "trl"), default="stream")
    parser.add_argument("--objective", choices=("sft", "dpo", "kto", "reward", "grpo", "rloo"), default="sft")
    parser.add_argument("--world-one", action="store_true")
    parser.add_argument("--unsplit", action="store_true", help="ZeRO-3 without the split: each rank a row of its own")
    parser.add_argument(
        "--padding-free", action="store_true", help="SFT on padding-free rows: each step's two examples packed in one"
    )
    parser.add_argument("--packing", action="store_true", help="SFT with packing=True (bfd): two examples a row")
    parser.add_argument("--peft", action="store_true", help="a LoRA adapter trained (DPO: its reference disabled)")
    parser.add_argument("--qlora", action="store_true", help="with --peft: the base weights in NF4 (float32 storage)")
    parser.add_argument("--eval", action="store_true", help="evaluate four other rows after each step")
    parser.add_argument(
        "--cp", action="store_true", help="context parallelism (cp_size=N) under FSDP2 in place of DeepSpeed's split"
    )
    parser.add_argument(
        "--any-length", action="store_true", help="SFT rows not padded to a multiple of the split (pad_to_multiple_of)"
    )
    parser.add_argument("--window", type=int, help="the causal LM's every layer a sliding window of this many keys")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])

    from datasets import Dataset
    from distributed_trainer import deepspeed_config, full_parameters, gloo_state
    from helpers import LengthReward, load_model, load_tokenizer, tiny_dataset
    from helpers import args as config_args
    from trl import SFTConfig, SFTTrainer

    from streambp_trl import (
        StreamDPOConfig,
        StreamDPOTrainer,
        StreamGRPOConfig,
        StreamGRPOTrainer,
        StreamKTOConfig,
        StreamKTOTrainer,
        StreamRewardConfig,
        StreamRewardTrainer,
        StreamRLOOConfig,
        StreamRLOOTrainer,
        StreamSFTConfig,
        StreamSFTTrainer,
    )

    kinds = {"sft": "chat", "dpo": "preference", "kto": "unpaired_preference", "reward": "preference"}
    kind = kinds.get(args.objective, "prompt_completion")
    # (KTO's KL term pairs each completion with another row's prompt; GRPO: 4 completions of one prompt a rank;
    # padding-free SFT: two documents in each row)
    batch = {"kto": 2, "grpo": 4, "rloo": 4}.get(args.objective, 2 if args.padding_free else 1)
    row = (
        tiny_dataset(kind, 1).remove_columns("completion")[0] if args.objective in ONLINE else tiny_dataset(kind, 1)[0]
    )
    data = Dataset.from_list([row] * 2 * (batch if args.objective not in ONLINE else 1) * (1 + args.packing))

    from transformers import AutoModelForSequenceClassification

    saved = Path(args.out).parent / f"classifier-{os.environ['RANK']}"
    if args.objective == "reward":  # its sequence classifier (one score), saved before any ZeRO-3 partitioned init
        config = load_model().config
        config.num_labels = 1
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(saved)

    def causal_lm():  # the tiny Qwen3, or (--window) the same weights with sliding-window attention in every layer
        if not args.window:
            return load_model()
        from helpers import MODEL
        from transformers import AutoConfig, AutoModelForCausalLM

        layers = AutoConfig.from_pretrained(MODEL).num_hidden_layers
        windowed = dict(use_sliding_window=True, sliding_window=args.window, max_window_layers=0)
        windowed["layer_types"] = ["sliding_attention"] * layers
        return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, **windowed)

    def built():  # the model trained: the causal LM, or the reward model's classifier, loaded alike everywhere
        if args.qlora:  # (float32 storage: FSDP2 and ZeRO-3 shard the 4-bit weights as float32 tensors)
            from helpers import MODEL
            from transformers import AutoModelForCausalLM, BitsAndBytesConfig

            quantized = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.float32,
                bnb_4bit_quant_storage=torch.float32,
            )
            return AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=quantized, dtype=torch.float32)
        return causal_lm() if args.objective != "reward" else AutoModelForSequenceClassification.from_pretrained(saved)

    extra: dict = {}
    if not args.world_one and args.cp:
        from accelerate.parallelism_config import ParallelismConfig

        gloo_state("fsdp2")
        layer = type(load_model().model.layers[0]).__name__
        extra = dict(
            fsdp="full_shard auto_wrap",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer]},
            accelerator_config={"use_configured_state": True},
            parallelism_config=ParallelismConfig(cp_size=world),
        )
        if args.objective in ONLINE:  # as `accelerate launch` hands it over (their configs refuse one of their own)
            del extra["parallelism_config"]
            os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_CP_SIZE=str(world))
    elif not args.world_one:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        gloo_state("zero3")
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        extra = dict(
            deepspeed=deepspeed_config("zero3"),
            accelerator_config={"use_configured_state": True},
            parallelism_config=ParallelismConfig(
                sp_backend="deepspeed", sp_size=world, dp_replicate_size=1, sp_handler=handler
            ),
            use_cpu=False,
        )
        # as `accelerate launch` with configs/accelerate/zero3_sp.yaml hands it over (GRPO's and RLOO's configs refuse
        # a parallelism_config of their own)
        if args.objective in ONLINE or args.unsplit:
            del extra["parallelism_config"]
        if args.objective in ONLINE and not args.unsplit:
            os.environ.update(
                ACCELERATE_USE_PARALLELISM_CONFIG="true",
                PARALLELISM_CONFIG_SP_SIZE=str(world),
                PARALLELISM_CONFIG_SP_BACKEND="deepspeed",
                PARALLELISM_CONFIG_DP_REPLICATE_SIZE="1",
                PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE="true",
                PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION="sdpa",
            )
    stream = args.trainer == "stream"
    config_cls, trainer_cls = (StreamSFTConfig, StreamSFTTrainer) if stream else (SFTConfig, SFTTrainer)
    if args.objective != "sft":
        config_cls, trainer_cls = {
            "dpo": (StreamDPOConfig, StreamDPOTrainer),
            "kto": (StreamKTOConfig, StreamKTOTrainer),
            "reward": (StreamRewardConfig, StreamRewardTrainer),
            "grpo": (StreamGRPOConfig, StreamGRPOTrainer),
            "rloo": (StreamRLOOConfig, StreamRLOOTrainer),
        }[args.objective]
    stream_args = dict(stream_chunk_size=4, logits_chunk_size=8) if stream else {}
    config = config_args(
        config_cls,
        str(Path(args.out).parent / "run"),
        per_device_train_batch_size=batch,
        max_steps=1 if args.objective in ONLINE else 2,  # (online: the first step's samples are alike in every run)
        learning_rate=LR if args.objective == "sft" else LR / 20,  # (DPO's loss saturates in one step at 1.0)
        **(
            {"max_length": 192 if args.packing else None if args.padding_free else 128}
            if args.objective not in ONLINE
            else {}
        ),
        **(
            dict(pad_to_multiple_of=None if args.any_length else 2 * world, padding_free=args.padding_free)
            if args.objective == "sft"
            else {}
        ),
        **({"packing": True} if args.packing else {}),
        **(dict(num_generations=4, max_completion_length=8, temperature=0.7) if args.objective in ONLINE else {}),
        **(dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=1) if args.eval else {}),
        **stream_args,
        **extra,
    )
    from streambp_trl.engine import decoder_forward

    # (rank, ranks, tokens, with grad) of each streamed decoder call the engine split: the policy's with grad, a
    # reference's without
    splits = []
    call_split = decoder_forward._call_split

    def recorded(*given):
        split = call_split(*given)
        if split is not None:
            splits.append((split.rank, split.size, split.length, torch.is_grad_enabled()))
        return split

    decoder_forward._call_split = recorded
    model = built()  # after the config: under ZeRO-3 transformers builds it partitioned (zero.Init)
    # (ZeRO-3: a reference passed in)
    reference = {"ref_model": causal_lm()} if args.objective in ("dpo", "kto") and not args.peft else {}
    if args.peft:
        from peft import LoraConfig

        reference["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    if args.eval:  # other rows than the training row's, each rank evaluating its own (eval does not split)
        reference["eval_dataset"] = tiny_dataset(kind, 4)
    reward = LengthReward()
    if args.objective in ONLINE:
        reference = {"reward_funcs": [reward]}
    trainer = trainer_cls(model=model, args=config, train_dataset=data, processing_class=load_tokenizer(), **reference)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    trainer.train()
    own_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # (DeepSpeed's Ulysses exchange replaces it)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    after = full_parameters(unwrapped)
    # hooks on the attention modules (accelerate's context-parallel preparation would add one dropping their masks)
    hooks = sum(len(m._forward_pre_hooks) for n, m in unwrapped.named_modules() if n.endswith("self_attn"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    if int(os.environ["RANK"]) == 0:
        record = {"after": after, "losses": losses, "splits": splits, "own_sdpa": own_sdpa, "attention_hooks": hooks}
        record["eval_losses"] = eval_losses
        record["completions"] = reward.seen
        torch.save(record, args.out)
    if world > 1:
        dist.barrier()
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


if __name__ == "__main__":
    main()
