"""The key/value cache a streamed layer runs each chunk against, and the full-length keys/values of one layer.

:class:`CarryStore` holds every position's keys/values of each cache slot (``layer_idx``), (batch, kv_heads, T,
head_dim) each. :class:`ChunkCache` is a ``transformers.Cache`` for one layer call on one chunk: the model's own
attention code calls its ``update()``, which writes the chunk's keys/values into the store and returns the store's
view of the prefix and the chunk, so no concatenated copy of the prefix is ever made. In a backward recompute the
prefix is a gradient-carrying leaf and :class:`_Extend` joins it to the chunk's keys/values (a view again), handing
the attention's gradient back to both as views; for the joined tensors the cache also records a :class:`PrefixGrad`
pair (in ``prefix_grads``, which the chunk's mask shares), with which an attention kernel can add the prefix's
gradient straight into the layer's key/value gradient sums instead.

The prefix keys/values are a layer's *carry* for softmax attention: what a chunk takes from earlier positions. In
backward a chunk receives its carry as leaves that require grad, and their gradient (``dK``, ``dV`` of the prefix
positions) is what it hands back to the earlier chunks.

A sparse indexed attention (DeepSeek Sparse Attention's indexer, which chooses each query's keys by a top-k over its
scores of the keys) also caches *indexer keys* through ``update_indexer()``: the store keeps them for every position,
(batch, T, index_head_dim) per slot, and serves a chunk all of them from the prefix start to T (see
:meth:`ChunkCache.update_indexer`). The indexer's output is integer indices, so they carry no gradient.

Modules: :mod:`.store` (:class:`CarryStore`: the full-length keys/values and the states entering each chunk),
:mod:`.cache` (:class:`ChunkCache`, the cache a chunk runs against, and the collecting pass's early stop),
:mod:`.layer_carry` (:class:`LayerCarry`: a layer backward's carry leaves and their gradient sums).
"""

from .cache import ChunkCache, StopAfterCacheUpdate, queries_skipped
from .layer_carry import LayerCarry
from .store import INDEXER, CarryStore

__all__ = ["INDEXER", "CarryStore", "ChunkCache", "LayerCarry", "StopAfterCacheUpdate", "queries_skipped"]
