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
