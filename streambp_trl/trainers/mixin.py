"""What every ``Stream*Trainer`` adds to its TRL trainer: one place to install the engine and log it."""

from __future__ import annotations

import copy
import logging

import torch

from ..engine import enable_streambp
from .stream_config import resolve_stream_options

logger = logging.getLogger(__name__)


def take_over_checkpointing(args):
    """``args``, or a copy of it with Hugging Face activation checkpointing off: the stream engine checkpoints (and
    streams) every decoder layer itself. The caller's config object is never changed."""
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return args
    logger.info("gradient_checkpointing=True is provided by the stream engine; Hugging Face's own is turned off.")
    args = copy.copy(args)
    args.activation_checkpointing = args.gradient_checkpointing = False
    return args


class StreamTrainerMixin:
    """Installs StreamBP on ``self.model`` and logs the stream settings and, on CUDA, the peak memory of each step."""

    def _install_stream_engine(self, max_length: int | None, **engine_kwargs) -> None:
        self.stream_options = resolve_stream_options(self.args, max_length)
        enable_streambp(self.model, **self.stream_options, **engine_kwargs)

    def training_step(self, *args, **kwargs):
        cuda = torch.cuda.is_available() and self.args.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.args.device)
        loss = super().training_step(*args, **kwargs)
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.args.device) / 2**30
            self._metrics["train"]["peak_memory_gib"].append(peak)
        return loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.model.training and "loss" in logs:
            logs["stream_chunk_size"] = self.stream_options["stream_chunk_size"]
            logs["logits_chunk_size"] = self.stream_options["logits_chunk_size"]
        super().log(logs, *args, **kwargs)
