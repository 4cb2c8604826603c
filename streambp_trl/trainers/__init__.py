"""The ``Stream*Trainer`` / ``Stream*Config`` pairs: TRL's trainers with the stream engine installed."""

from .distillation_config import StreamDistillationConfig
from .distillation_trainer import StreamDistillationTrainer
from .dpo_config import StreamDPOConfig
from .dpo_trainer import StreamDPOTrainer
from .grpo_config import StreamGRPOConfig
from .grpo_trainer import StreamGRPOTrainer
from .kto_config import StreamKTOConfig
from .kto_trainer import StreamKTOTrainer
from .reward_config import StreamRewardConfig
from .reward_trainer import StreamRewardTrainer
from .rloo_config import StreamRLOOConfig
from .rloo_trainer import StreamRLOOTrainer
from .sft_config import StreamSFTConfig
from .sft_trainer import StreamSFTTrainer

__all__ = [
    "StreamDistillationConfig",
    "StreamDistillationTrainer",
    "StreamDPOConfig",
    "StreamDPOTrainer",
    "StreamGRPOConfig",
    "StreamGRPOTrainer",
    "StreamKTOConfig",
    "StreamKTOTrainer",
    "StreamRewardConfig",
    "StreamRewardTrainer",
    "StreamRLOOConfig",
    "StreamRLOOTrainer",
    "StreamSFTConfig",
    "StreamSFTTrainer",
]
