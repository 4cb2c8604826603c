"""The measuring harness: real forward+backward steps measured in fresh processes, the ``streambp-trl max-len``
search, and what the scripts in ``scripts/`` share.

It imports the runtime (the engine, :mod:`streambp_trl.sizing`) and builds on it; the runtime never imports it.
"""
