"""``StreamRewardTrainer``: TRL's ``RewardTrainer`` with the reward model's decoder streamed."""

from __future__ import annotations

from trl import RewardTrainer

from .mixin import StreamTrainerMixin
from .reward_config import StreamRewardConfig


class StreamRewardTrainer(StreamTrainerMixin, RewardTrainer):
    """Drop-in for [`~trl.RewardTrainer`]; accepts a [`StreamRewardConfig`] or a plain [`~trl.RewardConfig`].

    The model is a `*ForSequenceClassification` decoder (loaded with `num_labels=1` from a name, as TRL does). Its
    decoder streams chunk by chunk and the score head reads only the last non-pad token of each sequence (see
    `streambp_trl.engine.score_head`), so the rewards TRL's loss reads are exact: the Bradley-Terry loss, `margin`
    columns, `center_rewards_coefficient`, LoRA (`task_type="SEQ_CLS"`, the score head in `modules_to_save`) and the
    metrics TRL logs are TRL's own code. No logit kernel runs (the score head reads one row per sequence), so
    `logits_chunk_size` is not logged.
    """

    logits_tiled = False

    config_class = StreamRewardConfig
    sequence_rows = "whole"  # each row's score is read at its last token, on the rank holding it (engine.whole_rows)
    rows_per_example = 2  # TRL stacks each example's chosen and rejected completions in one call

    def __init__(self, model, args=None, *pos, **kwargs):
        super().__init__(model, self._stream_args(args, model), *pos, **kwargs)
