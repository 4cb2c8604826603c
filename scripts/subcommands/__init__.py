"""The subcommands of ``scripts/cpu.py``, ``scripts/gpu.py`` and ``scripts/sim.py``, one module each, named after
its entry point: ``cpu_bp`` is ``cpu.py bp``, ``gpu_long_context`` is ``gpu.py long-context``, ``sim_grid`` is
``sim.py grid``. Beside them: ``common`` (paths, the dispatch, the fresh-process protocol), ``plots`` (the plots'
style), and the parts of the larger GPU subcommands: ``gpu_bench_budget`` (its time and memory budgets),
``gpu_bench_output`` (its summary, report and plots), ``gpu_profile_trace`` (the profiled trace's analysis).

A module's ``main(argv, prog)`` is its subcommand; the measuring itself is ``streambp_trl.bench``'s.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's streambp_trl, installed or not
