"""``StreamDistillationConfig``: TRL's ``DistillationConfig`` plus the stream options."""

from dataclasses import dataclass

from trl import DistillationConfig

from .stream_config import StreamArguments


@dataclass
class StreamDistillationConfig(StreamArguments, DistillationConfig):
    """[`~trl.DistillationConfig`] with the options of [`StreamArguments`].

    `activation_checkpointing` (on by default, as in TRL) is taken over by the stream engine, which checkpoints and
    streams every decoder layer of the student and streams the teacher's no-grad forward itself. `logits_chunk_size`
    is the token tile of the divergence kernel.
    """
