"""The stream-checkpointed decoder layer: each decoder layer's forward and backward, chunk by chunk.

* :mod:`.stream_layer`: the autograd Function installed as each layer's checkpoint hook (:func:`stream_checkpoint`);
* :mod:`.kv_cache`: the cache a chunk runs against, and the full-length keys/values of one layer;
* :mod:`.layer_args`: a layer call's arguments, split per chunk;
* :mod:`.offload`: the saved inputs in pinned host memory between forward and backward;
* :mod:`.rebuild`: the first layer's input rebuilt from the token ids instead of kept.
"""

from .offload import CheckpointOffload
from .stream_layer import KV_MODES, StreamSettings, stream_checkpoint

__all__ = ["KV_MODES", "CheckpointOffload", "StreamSettings", "stream_checkpoint"]
