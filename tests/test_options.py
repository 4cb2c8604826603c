"""Every stream option is checked in one place (``StreamOptions.__post_init__``): a bad value gives the same message
through ``enable_streambp``, through a ``Stream*Config`` and through the command line."""

import dataclasses
import re
from pathlib import Path

import pytest
from models import tiny_model

from streambp_trl import StreamOptions, StreamSFTConfig, enable_streambp
from streambp_trl.cli import UsageError, parse_args

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "sft_tiny.yaml")

# (option, config field, bad value, what the message must say)
BAD = [
    ("stream_chunk_size", "stream_chunk_size", 0, "stream_chunk_size must be a positive integer"),
    ("stream_chunk_size", "stream_chunk_size", "big", "stream_chunk_size must be a positive integer"),
    ("logits_chunk_size", "logits_chunk_size", -3, "logits_chunk_size must be a positive integer"),
    ("kv_mode", "stream_kv_mode", "offload", "kv_mode (stream_kv_mode in a config) must be one of"),
    ("keep_every", "stream_keep_every", 0, "keep_every (stream_keep_every in a config) must be a positive integer"),
    ("memory_budget", "memory_budget", "lots", "memory_budget: "),
    ("memory_budget", "memory_budget", "0GiB", "memory_budget must be a positive size"),
    ("memory_budget", "memory_budget", "80", "memory_budget: '80' has no unit: write 80GiB (binary), 80GB (decimal)"),
]


def _message(error: pytest.ExceptionInfo) -> str:
    return str(error.value)


@pytest.mark.parametrize(("option", "field", "value", "says"), BAD)
def test_a_bad_option_gives_one_message_everywhere(option, field, value, says):
    with pytest.raises(ValueError) as direct:
        StreamOptions(**{"stream_chunk_size": 4, option: value})
    assert says in _message(direct)
    with pytest.raises(ValueError) as enabled:
        enable_streambp(tiny_model("llama"), **{"stream_chunk_size": 4, option: value})
    with pytest.raises(ValueError) as config:
        StreamSFTConfig(output_dir="unused", **{field: value})
    with pytest.raises(UsageError) as cli:
        parse_args("sft", ["--config", CONFIG, f"--{field}", str(value)])
    assert _message(enabled) == _message(config) == _message(direct)
    assert _message(cli) == re.sub(r"\s+", " ", _message(direct)).strip()


def test_options_are_normalised_once():
    options = StreamOptions(stream_chunk_size=8, memory_budget="1GiB", fused_outputs=("entropy",), temperature=2)
    assert options.logits_chunk_size == 8 and options.memory_budget == "1GiB" and options.choices.budget == 2**30
    assert options.fused_outputs == ("log_probs", "entropy") and options.temperature == 2.0
    config = StreamSFTConfig("unused", bf16=False, stream_chunk_size="512", stream_kv_mode="capture")
    assert config.to_options() == StreamOptions(stream_chunk_size=512, kv_mode="capture")


def test_enable_takes_the_options_object():
    model = enable_streambp(tiny_model("llama"), StreamOptions(stream_chunk_size=4), keep_every=2)
    assert model._streambp.options == StreamOptions(stream_chunk_size=4, keep_every=2)


@pytest.mark.parametrize("budget", [80, 80.0, "80"])
def test_a_memory_budget_without_a_unit_is_refused_not_read_as_bytes(budget, tmp_path):
    """``memory_budget: 80`` (YAML's int) or ``80`` in Python was read as 80 bytes, and "auto" took the smallest
    chunk everywhere without a word; a size says its unit (``4096B`` for bytes)."""
    with pytest.raises(ValueError, match="memory_budget: '80(.0)?' has no unit: write 80(.0)?GiB"):
        StreamOptions(stream_chunk_size="auto", memory_budget=budget)
    config = tmp_path / "sft.yaml"
    config.write_text(Path(CONFIG).read_text().replace("stream_chunk_size: 32", f"memory_budget: {budget}"))
    with pytest.raises(UsageError, match="has no unit"):
        parse_args("sft", ["--config", str(config)])
    assert StreamOptions(stream_chunk_size="auto", memory_budget="4096B").choices.budget == 4096
    kept = StreamOptions(stream_chunk_size="auto", memory_budget="78GiB")
    assert dataclasses.replace(kept, temperature=2.0).choices.budget == 78 * 2**30
