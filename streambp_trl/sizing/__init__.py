"""Sizing a step for the engine: the memory model (:mod:`.memory_model`), the ``"auto"`` chunk policy (:mod:`.auto`)
and the named model shapes (:mod:`.shapes`). The measuring harness is :mod:`streambp_trl.bench`."""
