"""The forms of the logit kernels' gradient (:mod:`streambp_trl.logits`), one name each."""

from __future__ import annotations

import enum


class HeadForm(enum.StrEnum):
    """The form of a logit kernel's gradient, by the memory it takes: ``TWO_NODE`` (4 vocabulary passes in backward:
    the weight's gradient vocabulary tile by vocabulary tile in a node of its own, no (vocab x hidden) float32
    accumulator), ``FUSED`` (3 passes: the weight's gradient accumulated in the hidden states' sweep) and ``EAGER``
    (the gradient's bases formed in the forward, each logit computed once; only where the loss weights every row
    alike, checked in backward, which otherwise recomputes as the fused form does)."""

    TWO_NODE = "two-node"
    FUSED = "fused"
    EAGER = "eager"


HEAD_FORMS = tuple(HeadForm)  # by the memory taken, least first
