"""streambp-trl: exact StreamBP (sequence-chunked backpropagation) for Hugging Face TRL trainers."""

from .engine import StreamOptions, disable_streambp, enable_streambp
from .logits import chunked_logprobs
from .trainers import (
    StreamDistillationConfig,
    StreamDistillationTrainer,
    StreamDPOConfig,
    StreamDPOTrainer,
    StreamGRPOConfig,
    StreamGRPOTrainer,
    StreamKTOConfig,
    StreamKTOTrainer,
    StreamRewardConfig,
    StreamRewardTrainer,
    StreamRLOOConfig,
    StreamRLOOTrainer,
    StreamSFTConfig,
    StreamSFTTrainer,
)

__all__ = [
    "StreamDistillationConfig",
    "StreamDistillationTrainer",
    "StreamDPOConfig",
    "StreamDPOTrainer",
    "StreamGRPOConfig",
    "StreamGRPOTrainer",
    "StreamKTOConfig",
    "StreamKTOTrainer",
    "StreamOptions",
    "StreamRewardConfig",
    "StreamRewardTrainer",
    "StreamRLOOConfig",
    "StreamRLOOTrainer",
    "StreamSFTConfig",
    "StreamSFTTrainer",
    "chunked_logprobs",
    "disable_streambp",
    "enable_streambp",
]
__version__ = "0.1.0"
