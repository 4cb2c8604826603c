"""``StreamSFTConfig``: TRL's ``SFTConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import SFTConfig

from .stream_config import StreamArguments


@dataclass
class StreamSFTConfig(StreamArguments, SFTConfig):
    """[`~trl.SFTConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer itself; the trainer turns Hugging Face's own checkpointing off so layers are not
    wrapped twice.
    """
