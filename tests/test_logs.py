"""The engine's log lines print where transformers' do (issue 47): at transformers' verbosity, on stderr, once."""

from __future__ import annotations

import logging

import pytest
from models import batch, tiny_model
from transformers.utils import logging as transformers_logging

from streambp_trl import enable_streambp


@pytest.fixture
def verbosity():
    before = transformers_logging.get_verbosity()
    root = logging.getLogger("streambp_trl")
    root.propagate = False  # as outside the tests (conftest turns it on for caplog): stderr alone
    yield transformers_logging.set_verbosity
    transformers_logging.set_verbosity(before)


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_the_plan_prints_at_transformers_verbosity(verbosity, capsys, level):
    """``set_verbosity_info()`` (what a Trainer's ``log_level`` and the CLI's ``--log_level info`` set) shows the
    plan of a new call shape in one line on stderr; at transformers' default (warning) it is not shown."""
    verbosity(level)
    model = enable_streambp(tiny_model("llama"), stream_chunk_size="auto", memory_budget="64MiB")
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    err = capsys.readouterr().err
    plans = [line for line in err.splitlines() if line.startswith("StreamBP plan for")]
    assert len(plans) == (1 if level == logging.INFO else 0), err
    assert "is not streamed" in err  # a warning prints at either verbosity


def test_a_call_with_every_choice_fixed_says_how_it_runs(verbosity, capsys):
    """Where nothing is planned (every option fixed, no budget), the INFO line still says how each new call shape
    runs, and that it is not checked against memory."""
    verbosity(logging.INFO)
    fixed = dict(stream_chunk_size=4, keep_every=1, offload_checkpoints=False, kv_mode="recompute")
    model = enable_streambp(tiny_model("llama"), **fixed)
    ids, mask, labels = batch()
    for _ in range(2):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    plans = [line for line in capsys.readouterr().err.splitlines() if line.startswith("StreamBP plan for")]
    assert plans == [
        "StreamBP plan for 46 tokens: chunk 4, every layer input kept, as configured (no memory_budget: not checked "
        "against memory)."
    ]
