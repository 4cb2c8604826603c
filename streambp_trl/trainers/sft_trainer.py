"""``StreamSFTTrainer``: TRL's ``SFTTrainer`` with streamed decoder layers and the chunked logit kernel."""

from __future__ import annotations

import dataclasses

from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from ..engine import PACKING_KWARGS, packed_rows_refusal
from .mixin import StreamTrainerMixin
from .sft_config import StreamSFTConfig


class StreamSFTTrainer(StreamTrainerMixin, SFTTrainer):
    """Drop-in for [`~trl.SFTTrainer`]; accepts a [`StreamSFTConfig`] or a plain [`~trl.SFTConfig`].

    Data pipeline, loss types (`nll`, `dft`), masks (`assistant_only_loss`, `completion_only_loss`), packing,
    padding-free batches, gradient accumulation and PEFT are TRL's own: TRL's loss reads the per-token log-probs of
    `model(..., fused_lm_head=True)`, which the stream engine serves exactly.
    """

    config_class = StreamSFTConfig
    sequence_rows = (
        "shares"  # DeepSpeed's Ulysses data path, as TRL documents it for SFT (the Trainer reduces the loss)
    )

    def __init__(self, model, args=None, *pos, **kwargs):
        # the engine installs after TRL's own fused head: the same `fused_lm_head=True` call, served by the engine
        super().__init__(model, self._stream_args(args, model), *pos, **kwargs)
        refusal = packed_rows_refusal(self.model) if self.padding_free else None  # packing="bfd" or padding_free
        if refusal is not None:
            raise ValueError(f"{type(self).__name__}: {refusal}")
        if self.padding_free and self.splits_sequences and type(self.data_collator) is DataCollatorForLanguageModeling:
            # DeepSpeed's Ulysses data path hands each rank its share of every (batch, T) field, and takes no (n + 1)
            # cumulative lengths: the split rows keep their documents apart by the global position ids alone
            self.data_collator = PositionsOnlyCollator.of(self.data_collator)

    def _longest_batch(self) -> tuple[tuple[int, int], str] | None:
        """Padding-free batches (``padding_free``, or ``packing`` with the "bfd" strategies) are one row of every
        example's tokens: per_device_train_batch_size x max_length at most."""
        longest = super()._longest_batch()
        if longest is None or not self.padding_free:
            return longest
        (rows, tokens), why = longest
        return (1, rows * tokens), why + ", padding-free: one row"

    def _fused_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy", "is_top1")

    def _engine_options(self) -> dict:
        # TRL's `nll` loss is the token mean of -log p (its other losses read the fused head without grad, or weight
        # tokens by their probability: `dft`, which the kernel's backward check sends to the recompute)
        return {"token_mean_loss": self.args.loss_type == "nll"}


@dataclasses.dataclass
class PositionsOnlyCollator(DataCollatorForLanguageModeling):
    """TRL's padding-free collator without the packed rows' sequence descriptors (``cu_seq_lens_q``, ...) in its
    batches: their documents are told apart by the ``position_ids``, which restart at each document's start."""

    @classmethod
    def of(cls, collator: DataCollatorForLanguageModeling) -> PositionsOnlyCollator:
        """``collator``'s settings, the descriptors left out."""
        return cls(**{f.name: getattr(collator, f.name) for f in dataclasses.fields(collator) if f.init})

    def torch_call(self, examples: list) -> dict:
        return {k: v for k, v in super().torch_call(examples).items() if k not in PACKING_KWARGS}
