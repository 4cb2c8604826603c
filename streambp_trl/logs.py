"""StreamBP's log lines where transformers' go: the package's loggers (``streambp_trl.*``, from :func:`get_logger`)
print at transformers' verbosity, so ``transformers.logging.set_verbosity_info()``, a Trainer's ``log_level`` and the
CLI's ``--log_level info`` show the engine's INFO lines (the plan of each new call shape) as they show transformers'.

As transformers does for its own loggers, the package's root logger has one handler on stderr and does not pass its
records on to the root logger (a ``logging.basicConfig`` handler would print them twice); unlike it, the handler
reads the verbosity at each record, so a change of verbosity after import applies, and it writes through
``tqdm.write``, above a progress bar rather than into it. Tests capture the records by turning propagation back on.
"""

from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

ROOT = "streambp_trl"


class _AtTransformersVerbosity(logging.Handler):
    """Writes each record at or above transformers' verbosity to stderr, above any active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < transformers_logging.get_verbosity():
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging's own rule: a failing handler reports, never raises)
            self.handleError(record)


def _configure_root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _AtTransformersVerbosity) for h in root.handlers):
        root.addHandler(_AtTransformersVerbosity())
        root.setLevel(logging.DEBUG)  # the handler applies transformers' verbosity
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__`` of a ``streambp_trl`` module), printing at transformers'
    verbosity (see the module docstring)."""
    _configure_root()
    return logging.getLogger(name)
