"""The ``Stream*Trainer`` / ``Stream*Config`` pairs: TRL's trainers with the stream engine installed."""

from .dpo_config import StreamDPOConfig
from .dpo_trainer import StreamDPOTrainer
from .kto_config import StreamKTOConfig
from .kto_trainer import StreamKTOTrainer
from .sft_config import StreamSFTConfig
from .sft_trainer import StreamSFTTrainer

__all__ = [
    "StreamDPOConfig",
    "StreamDPOTrainer",
    "StreamKTOConfig",
    "StreamKTOTrainer",
    "StreamSFTConfig",
    "StreamSFTTrainer",
]
