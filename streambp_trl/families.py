"""What a model family differs by where no layer adapter (:mod:`streambp_trl.layers.adapters`) is the cause: one table,
by the text config's ``model_type``. Nothing else in the package matches model types or family names; the adapters
detect their traits from the modules' code.

* :data:`UNCOUNTED`: the tensors a family's streamed step holds that the memory model does not count, said at enable
  wherever a plan sizes the step (:class:`~streambp_trl.sizing.auto.AutoChunks`);
* :data:`LOGITS_SCALING_MULTIPLIES`: the families whose ``logits_scaling`` multiplies the logits (the others divide
  by it: Granite, MiniCPM3), read where the logit kernel applies a model's own logit transform.
"""

from __future__ import annotations

UNCOUNTED: dict[str, str] = {
    "deepseek_v4": "its compressed attention's carried entries",
    "doge": "its dynamic mask's blocks",
    "gemma3n_text": "its per-layer inputs and the keys/values its last layers share",
    "gemma4_text": "its per-layer inputs and the keys/values its last layers share (where it has them)",
    "gpt_oss": "its attention sinks' keys/values, copied to the query heads in each chunk's attention",
    "inkling2_text": "its relative-position bias and attention sinks",
    "zaya": "its float32 residual stream, its router stream and its CCA convolutions",
    "xlstm": "its mLSTM layers (their chunk backward and carried states)",
}
LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})


def uncounted(config) -> str | None:
    """What the memory model leaves out of the family of the text config ``config`` (``None``: nothing)."""
    return UNCOUNTED.get(getattr(config, "model_type", None))


def logits_scaling_multiplies(config) -> bool:
    """Whether the text config ``config``'s ``logits_scaling`` multiplies its logits rather than dividing them."""
    return getattr(config, "model_type", None) in LOGITS_SCALING_MULTIPLIES
