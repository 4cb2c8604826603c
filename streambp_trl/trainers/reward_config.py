"""``StreamRewardConfig``: TRL's ``RewardConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import RewardConfig

from .stream_config import StreamArguments


@dataclass
class StreamRewardConfig(StreamArguments, RewardConfig):
    """[`~trl.RewardConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer of the reward model itself. `activation_offloading=True` is the engine's
    `offload_checkpoints=True` (each layer's saved input in host memory), never TRL's offloading on top of it.
    """
