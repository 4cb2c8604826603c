"""``StreamKTOTrainer``: TRL's ``KTOTrainer`` with the policy, KL and reference passes streamed."""

from __future__ import annotations

from trl import KTOTrainer

from .kto_config import StreamKTOConfig
from .mixin import StreamTrainerMixin


class StreamKTOTrainer(StreamTrainerMixin, KTOTrainer):
    """Drop-in for [`~trl.KTOTrainer`]; accepts a [`StreamKTOConfig`] or a plain [`~trl.KTOConfig`].

    KTO's loss types and its KL term are TRL's own code on the per-token log-probs of
    `model(..., labels=..., fused_lm_head=True)`, which the stream engine serves exactly for the policy, the KL
    completions and the reference (a separate `ref_model`, the PEFT policy with its adapter disabled, or
    `precompute_ref_log_probs`).
    """

    config_class = StreamKTOConfig
    sequence_rows = "whole"  # TRL's loss reads whole sequences' log-probs: every rank of a split trains the same batch

    def __init__(self, model, ref_model=None, args=None, *pos, **kwargs):
        super().__init__(model, ref_model, self._stream_args(args, model), *pos, **kwargs)

    def _fused_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy", "mean_logits")  # what TRL's KTOTrainer asks of its fused head

    def _precompute_ref_logps(self, *args, **kwargs):
        self._install_stream_engine()  # TRL precomputes inside its __init__
        return super()._precompute_ref_logps(*args, **kwargs)
