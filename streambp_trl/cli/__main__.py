"""``python -m streambp_trl.cli``: the ``streambp-trl`` command."""

from . import main

main()
