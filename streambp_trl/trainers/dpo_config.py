"""``StreamDPOConfig``: TRL's ``DPOConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import DPOConfig

from .stream_config import StreamArguments


@dataclass
class StreamDPOConfig(StreamArguments, DPOConfig):
    """[`~trl.DPOConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer of the policy (and streams the reference model's no-grad passes) itself.
    """
