"""The ``Stream*Trainer`` / ``Stream*Config`` pairs: TRL's trainers with the stream engine installed."""

from .sft_config import StreamSFTConfig
from .sft_trainer import StreamSFTTrainer

__all__ = ["StreamSFTConfig", "StreamSFTTrainer"]
