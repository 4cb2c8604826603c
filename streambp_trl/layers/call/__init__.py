"""One decoder-layer call, streamed: the autograd Function and the chunk loops it drives.

* :mod:`.stream_layer`: the autograd Function, chunk by chunk (the math and memory);
* :mod:`.layer_call`: one layer call, built once (its arguments per chunk), its chunked forward and the record that
  forward returns;
* :mod:`.backward`: each chunk's backward, last to first, and the key/value collection, functions of the call and
  its record;
* :mod:`.kept`: a layer call whose forward keeps its chunks' graphs, so its backward recomputes nothing;
* :mod:`.unread`: the linear maps whose output no gradient reads, which the chunk recompute skips;
* :mod:`.guards`: what a backward checks first (versions, a second backward, ``create_graph``).
"""

from .backward import ChunkBackward
from .kept import keeps_activations
from .layer_call import (
    ChunkedForward,
    ForwardRecord,
    LayerCall,
    RecordedCall,
    layer_name,
    returned,
)
from .stream_layer import StreamLayerFunction

__all__ = [
    "ChunkBackward",
    "ChunkedForward",
    "ForwardRecord",
    "LayerCall",
    "RecordedCall",
    "StreamLayerFunction",
    "keeps_activations",
    "layer_name",
    "returned",
]
