"""``StreamRLOOTrainer``: TRL's ``RLOOTrainer`` with the policy, old-policy and reference passes streamed."""

from __future__ import annotations

from trl import RLOOTrainer

from .mixin import StreamOnlineRLMixin
from .rloo_config import StreamRLOOConfig


class StreamRLOOTrainer(StreamOnlineRLMixin, RLOOTrainer):
    """Drop-in for [`~trl.RLOOTrainer`]; accepts a [`StreamRLOOConfig`] or a plain [`~trl.RLOOConfig`].

    Generation, rewards and advantages are TRL's own (the engine leaves generation, which brings a key/value cache,
    to the model's own code, in training mode too). Every loss type is TRL's code on the per-token log-probs and
    entropies of `model(..., labels=..., fused_lm_head=True)` at the sampling temperature, which the stream engine
    serves exactly for the policy, the old policy and the reference (a separate model in eval mode, or the PEFT
    policy with its adapter disabled).
    """

    config_class = StreamRLOOConfig

    def __init__(self, model, reward_funcs=None, args=None, *pos, **kwargs):
        super().__init__(model, reward_funcs, self._stream_args(args, model), *pos, **kwargs)
