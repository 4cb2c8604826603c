"""What a streamed layer keeps between its forward and its backward, and how the rest is rebuilt.

* :mod:`.offload`: the kept inputs (and captured keys/values) in pinned host memory between forward and backward;
* :mod:`.rebuild`: the first layer's input rebuilt from the token ids instead of kept;
* :mod:`.segments`: with ``keep_every`` k, the inputs of k - 1 of every k layers rebuilt from the first's.
"""

from .offload import CheckpointOffload
from .rebuild import EmbeddingOutputs, EmbeddingSource
from .segments import Segment

__all__ = ["CheckpointOffload", "EmbeddingOutputs", "EmbeddingSource", "Segment"]
