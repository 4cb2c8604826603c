import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _streambp_records_reach_caplog():
    """StreamBP's loggers keep their records from the root logger, as transformers' do (``streambp_trl.logs``);
    tests read them with ``caplog``, whose handler is on the root logger."""
    root = logging.getLogger("streambp_trl")
    root.propagate = True
    yield
    root.propagate = False
