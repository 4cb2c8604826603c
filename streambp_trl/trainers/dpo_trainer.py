"""``StreamDPOTrainer``: TRL's ``DPOTrainer`` with the policy and reference passes streamed."""

from __future__ import annotations

from trl import DPOTrainer

from .dpo_config import StreamDPOConfig
from .mixin import StreamTrainerMixin


class StreamDPOTrainer(StreamTrainerMixin, DPOTrainer):
    """Drop-in for [`~trl.DPOTrainer`]; accepts a [`StreamDPOConfig`] or a plain [`~trl.DPOConfig`].

    Every loss type and option is TRL's own code: it reads the per-token log-probs of
    `model(..., labels=..., fused_lm_head=True)` for the policy and the reference, which the stream engine serves
    exactly. The reference is streamed whichever way TRL computes it: a separate `ref_model` (in eval mode, no
    grad), the PEFT policy with its adapter disabled, or `precompute_ref_log_probs` before training.
    """

    config_class = StreamDPOConfig
    sequence_rows = "whole"  # TRL's loss reads whole sequences' log-probs: every rank of a split trains the same batch
    rows_per_example = 2  # TRL stacks each example's chosen and rejected completions in one call

    def __init__(self, model, ref_model=None, args=None, *pos, **kwargs):
        super().__init__(model, ref_model, self._stream_args(args, model), *pos, **kwargs)

    def _fused_outputs(self) -> tuple[str, ...]:
        # what TRL's DPOTrainer asks of its fused head: metrics, and the WPO weights with `use_weighting`
        return ("log_probs", "entropy", "mean_logits", "is_top1") + (
            ("log_sum_sq_probs",) if self.use_weighting else ()
        )

    def _precompute_ref_logps(self, *args, **kwargs):
        self._install_stream_engine()  # TRL precomputes inside its __init__
        return super()._precompute_ref_logps(*args, **kwargs)
