"""streambp-trl: exact StreamBP (sequence-chunked backpropagation) for Hugging Face TRL trainers."""

from .engine import disable_streambp, enable_streambp
from .logits import chunked_logprobs

__all__ = ["chunked_logprobs", "disable_streambp", "enable_streambp"]
__version__ = "0.1.0"
