"""``StreamGRPOConfig``: TRL's ``GRPOConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import GRPOConfig

from .stream_config import StreamArguments


@dataclass
class StreamGRPOConfig(StreamArguments, GRPOConfig):
    """[`~trl.GRPOConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer of the policy (and streams the old-policy and reference no-grad passes) itself.
    """
