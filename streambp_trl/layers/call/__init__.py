"""One decoder-layer call, streamed: the autograd Function and the chunk loops it drives.

* :mod:`.stream_layer`: the autograd Function, chunk by chunk (the math and memory);
* :mod:`.layer_call`: one layer call's chunk loops (forward, key/value collection) and its arguments per chunk;
* :mod:`.backward`: each chunk's backward, last to first;
* :mod:`.unread`: the linear maps whose output no gradient reads, which the chunk recompute skips;
* :mod:`.guards`: what a backward checks first (versions, a second backward, ``create_graph``).
"""

from .layer_call import KV_MODES, LayerCall, StreamSettings, layer_name
from .stream_layer import StreamLayerFunction

__all__ = ["KV_MODES", "LayerCall", "StreamLayerFunction", "StreamSettings", "layer_name"]
