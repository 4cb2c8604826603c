"""The stream-checkpointed decoder layer: each decoder layer's forward and backward, chunk by chunk.

* :mod:`.hook`: each layer's checkpoint hook (:func:`stream_checkpoint`), which runs the layer call through
* :mod:`.stream_layer`: the autograd Function, chunk by chunk;
* :mod:`.kv_cache`: the cache a chunk runs against, and the full-length keys/values of one layer;
* :mod:`.layer_args`: a layer call's arguments, split per chunk;
* :mod:`.offload`: the saved inputs in pinned host memory between forward and backward;
* :mod:`.rebuild`: the first layer's input rebuilt from the token ids instead of kept;
* :mod:`.segments`: with ``keep_every`` k, the inputs of k - 1 of every k layers rebuilt from the first's;
* :mod:`.rng`: each chunk's random state, replayed by every recompute.
"""

from .hook import stream_checkpoint
from .offload import CheckpointOffload
from .stream_layer import KV_MODES, StreamSettings

__all__ = ["KV_MODES", "CheckpointOffload", "StreamSettings", "stream_checkpoint"]
