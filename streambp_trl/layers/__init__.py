"""The stream-checkpointed decoder layer: each decoder layer's forward and backward, chunk by chunk.

* :mod:`.hook`: each layer's checkpoint hook (:func:`stream_checkpoint`, bound to its :class:`LayerFacts`), which runs
  the layer call through
* :mod:`.call`: the autograd Function, chunk by chunk, and one layer call's chunk loops (forward, key/value
  collection, each chunk's backward), skipped outputs and backward guards;
* :mod:`.rng`: a chunk's random state, kept from its forward and restored for each recompute (the layer call's and
  a ``keep_every`` segment's);
* :mod:`.decoder_call`: the state of one streamed decoder call, which the hooks read (:class:`DecoderCall`);
* :mod:`.carry`: the cache a chunk runs against (its carry: the prefix keys/values), and the full-length
  keys/values of one layer;
* :mod:`.continued`: the mixers that start from a zero state (Mamba v1, lightning attention), continued from the
  chunk's incoming state;
* :mod:`.layer_args`: a layer call's arguments, split per chunk;
* :mod:`.adapters`: the model-family adapters the hook composes around each chunk's run, one module per trait;
* :mod:`.traits`: what a transformers module class does, read once from its code (every source or bytecode reading);
* :mod:`.kept`: what a layer keeps between forward and backward, and how the rest is rebuilt (checkpoint offload, the
  first layer's input from the token ids, ``keep_every`` segments);
* :mod:`.dynamic_mask`: a dynamic mask attention's top-k window ranked over whole rows (Doge);
* :mod:`.shared_kv`: keys/values shared across layers (Gemma 3n, Gemma 4's E models);
* :mod:`.sharding`: whether parameters are ZeRO-3 partitions or FSDP shards.
"""

from .decoder_call import DecoderCall, decoder_call
from .hook import LayerFacts, stream_checkpoint
from .kept import CheckpointOffload

__all__ = [
    "CheckpointOffload",
    "DecoderCall",
    "LayerFacts",
    "decoder_call",
    "stream_checkpoint",
]
