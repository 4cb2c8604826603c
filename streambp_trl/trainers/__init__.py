"""The ``Stream*Trainer`` / ``Stream*Config`` pairs: TRL's trainers with the stream engine installed."""

from .dpo_config import StreamDPOConfig
from .dpo_trainer import StreamDPOTrainer
from .grpo_config import StreamGRPOConfig
from .grpo_trainer import StreamGRPOTrainer
from .kto_config import StreamKTOConfig
from .kto_trainer import StreamKTOTrainer
from .rloo_config import StreamRLOOConfig
from .rloo_trainer import StreamRLOOTrainer
from .sft_config import StreamSFTConfig
from .sft_trainer import StreamSFTTrainer

__all__ = [
    "StreamDPOConfig",
    "StreamDPOTrainer",
    "StreamGRPOConfig",
    "StreamGRPOTrainer",
    "StreamKTOConfig",
    "StreamKTOTrainer",
    "StreamRLOOConfig",
    "StreamRLOOTrainer",
    "StreamSFTConfig",
    "StreamSFTTrainer",
]
