"""streambp-trl: exact StreamBP (sequence-chunked backpropagation) for Hugging Face TRL trainers."""

from .engine import StreamOptions, disable_streambp, enable_streambp
from .logits import chunked_logprobs
from .trainers import (
    StreamDPOConfig,
    StreamDPOTrainer,
    StreamGRPOConfig,
    StreamGRPOTrainer,
    StreamKTOConfig,
    StreamKTOTrainer,
    StreamRLOOConfig,
    StreamRLOOTrainer,
    StreamSFTConfig,
    StreamSFTTrainer,
)

__all__ = [
    "StreamDPOConfig",
    "StreamDPOTrainer",
    "StreamGRPOConfig",
    "StreamGRPOTrainer",
    "StreamKTOConfig",
    "StreamKTOTrainer",
    "StreamOptions",
    "StreamRLOOConfig",
    "StreamRLOOTrainer",
    "StreamSFTConfig",
    "StreamSFTTrainer",
    "chunked_logprobs",
    "disable_streambp",
    "enable_streambp",
]
__version__ = "0.1.0"
