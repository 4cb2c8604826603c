"""Which decoder layers keep their input between a streamed call's forward and its backward.

A layer either keeps its input (on the device, or in host memory with checkpoint offload) or joins the segment of the
layer below it and gets its input back in backward, rebuilt from the segment's first input by one more chunked
forward of the layers below it in the segment (:mod:`streambp_trl.layers.kept.segments`). A :class:`Layout` says which:

* ``every`` k (the ``keep_every`` option): every segment has k layers, so ``ceil(L / k)`` inputs are kept, for k - 1
  more layer forwards out of every k;
* ``drop`` d: every layer keeps its input but layers ``L - 2, L - 4, ..., L - 2d`` (0-based, of L layers), each of
  which joins the layer below it. The step's peak is the top layer's backward, when every kept input is on the device
  beside its output gradient: each dropped input below the top layer takes one full-length input off that peak (and
  off every later layer's backward: a segment of two holds two inputs, one of which the layer above no longer kept),
  for one more layer forward. The top layer's own input cannot be dropped that way: its segment's backward would hold
  it anyway.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which layers keep their input: segments of ``every`` layers, or ``drop`` layers below the top one rebuilt."""

    every: int = 1
    drop: int = 0

    def __post_init__(self):
        if self.every < 1 or self.drop < 0 or (self.every > 1 and self.drop):
            raise ValueError(f"a layout has every >= 1 or drop >= 0, not both: got {self}.")

    def sizes(self, layers: int) -> tuple[int, ...]:
        """The size of a segment that starts at each layer index (what a layer that starts one gives it)."""
        if self.every > 1:
            return (self.every,) * layers
        starts = {layers - 1 - 2 * j for j in range(1, self.drop + 1)}
        return tuple(2 if i in starts and i >= 1 else 1 for i in range(layers))

    def segments(self, layers: int) -> list[tuple[int, int]]:
        """``(first layer, size)`` of each segment, bottom to top."""
        sizes, out, i = self.sizes(layers), [], 0
        while i < layers:
            size = min(sizes[i], layers - i)
            out.append((i, size))
            i += size
        return out

    def rebuilt(self, layers: int) -> int:
        """Layers whose input is rebuilt in backward: one more layer forward each."""
        return layers - len(self.segments(layers))

    def describe(self, layers: int) -> str:
        if self.every > 1:
            return f"every {_ordinal(self.every)} layer input kept ({self.rebuilt(layers)} rebuilt in backward)"
        if self.drop:
            return f"{self.drop} layer input{'s' if self.drop > 1 else ''} rebuilt in backward"
        return "every layer input kept"

    @staticmethod
    def drops(layers: int) -> int:
        """The most layers a ``drop`` layout can rebuild for ``layers`` layers."""
        return max((layers - 2) // 2, 0)


def _ordinal(k: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st, ..."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"
