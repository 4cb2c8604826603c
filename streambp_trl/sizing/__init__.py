"""Sizing a step for the engine: the memory model (:mod:`.memory_model`, its forward's peak in :mod:`.forward`, over
the shapes of :mod:`.model_shape` and the sizes of :mod:`.units`), the ``"auto"`` chunk policy (:mod:`.auto`) and the
named model shapes (:mod:`.shapes`). The measuring harness is :mod:`streambp_trl.bench`."""
