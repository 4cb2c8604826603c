"""``StreamKTOConfig``: TRL's ``KTOConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import KTOConfig

from .stream_config import StreamArguments


@dataclass
class StreamKTOConfig(StreamArguments, KTOConfig):
    """[`~trl.KTOConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer of the policy (and streams the reference model's no-grad passes) itself.
    """
