"""What a transformers module class does, read once from its code: the traits the stream layers and the engine
branch on (a recurrent or convolution mixer's cache interface, a decoder's position history, a mixer keeping a packed
row's documents apart, a layer reading its mask as a tensor, a state taken as an argument, a cache passed on through
``**kwargs``). Every reading of transformers' source or bytecode is here; :mod:`.layer_args` only binds and slices a
call's arguments.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Iterator

from .layer_args import STATE_ARGUMENT

# transformers' linear-attention cache interface: the methods a recurrent or convolution mixer reads its state with
_STATE_METHODS = frozenset({"get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state"})


def carries_state(cls: type) -> bool:
    """Whether ``cls`` is a recurrent or convolution mixer: a transformers module whose code calls the cache's state
    interface (``get_conv_state`` / ``update_recurrent_state`` ...). Gated DeltaNet, Mamba, Mamba2 and
    short-convolution mixers do; attention does not."""
    return bool(names_called(cls) & _STATE_METHODS)


def keeps_position_history(cls: type) -> bool:
    """Whether decoder class ``cls`` hands its layers the rotary embeddings of every cached position, not only the
    call's own: its code keeps those positions in the cache for a sparse indexed attention's indexer
    (``indexer_position_ids``; Qwen4-Exp), whose layers read the queries' embeddings as the last ones and the keys'
    at their index along the keys."""
    return "indexer_position_ids" in names_called(cls)


@functools.cache
def keeps_documents_apart(cls: type) -> bool | None:
    """Whether recurrent or convolution mixer class ``cls`` starts each document of a packed row from a zero state.

    transformers' sequence kernels (causal-conv1d, fla's delta rules, mamba-ssm's scans: the kernel functions of
    ``transformers.integrations.hub_kernels`` that take keyword arguments) keep the documents apart when a call hands
    them the row's sequence descriptors (``seq_idx``, ``cu_seqlens``, or the layer's ``**kwargs``, which carry them;
    their torch fallbacks refuse descriptors). ``True`` where every such call of the mixer's code does (Gated and
    Kimi DeltaNet, Mamba2, LFM2's short convolution), ``False`` where none does and its code reads no descriptor
    (the mixer runs across the documents), ``None`` where some calls do and others do not (Mamba v1 resets its
    convolution but not its selective scan). The one-token decoding kernels (``*state_update``, ``recurrent_*``)
    do not count: no chunk of a packed row takes them (a document's first chunk has no state; the others have at
    least two tokens)."""
    passes = [_passes_descriptors(call) for call in _kernel_calls(cls)]
    if passes and all(passes):
        return True
    if not any(passes) and not {"cu_seq_lens_q", "seq_idx"} & _strings(cls):
        return False
    return None


def _kernel_calls(cls: type) -> Iterator[ast.Call]:
    """The calls, in the source of transformers module class ``cls`` and its transformers bases, of a sequence
    kernel: a kernel function of ``hub_kernels`` (one it wraps, ``__wrapped__``) whose own (torch) implementation
    takes keyword arguments, other than a one-token decoding step."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        module = sys.modules[klass.__module__]
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            name, kernel = node.func.id, getattr(module, node.func.id, None)
            code = getattr(kernel, "__code__", None)
            if code is None or not code.co_filename.endswith("hub_kernels.py") or not hasattr(kernel, "__wrapped__"):
                continue
            if name.endswith("state_update") or "recurrent_" in name:
                continue
            own = inspect.signature(inspect.unwrap(kernel)).parameters.values()
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own):
                yield node


def _passes_descriptors(call: ast.Call) -> bool:
    return any(k.arg is None or k.arg in ("seq_idx", "cu_seqlens") for k in call.keywords)


@functools.cache
def _strings(cls: type) -> frozenset[str]:
    """The string constants of the code of transformers module class ``cls`` (the keys it reads from its kwargs)."""
    return frozenset(c for code in _code(cls) for c in code.co_consts if isinstance(c, str))


def reads_mask_as_tensor(cls: type) -> bool:
    """Whether the code of transformers module class ``cls`` reads the attention mask as a tensor rather than handing
    it to the attention interface as it is: a sparse indexed attention's indexer, which caches its keys through the
    cache's ``update_indexer`` and masks its scores with the mask (DeepSeek Sparse Attention), or a dynamic mask
    attention, which builds a per-head additive bias from the mask and its keys' values (Doge's
    ``prepare_dynamic_mask``)."""
    return bool({"update_indexer", "prepare_dynamic_mask", "update_compressor_states"} & names_called(cls))


@functools.cache
def takes_state_argument(cls: type) -> bool:
    """Whether ``cls.forward`` takes its recurrent state as an argument (:data:`STATE_ARGUMENT`: xLSTM's blocks)."""
    return STATE_ARGUMENT in inspect.signature(cls.forward).parameters


@functools.cache
def passes_keywords(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` (and so may pass a cache on to its modules)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())


@functools.cache
def names_called(cls: type) -> frozenset[str]:
    """The global and attribute names the code of transformers module class ``cls`` reads (any method of the class or
    of its transformers bases): the cache methods it calls, the module functions it runs."""
    return frozenset(name for code in _code(cls) for name in code.co_names)


def _code(cls: type) -> Iterator[types.CodeType]:
    """The code of each method of transformers module class ``cls`` and of its transformers bases."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        for member in vars(klass).values():
            code = getattr(inspect.unwrap(member), "__code__", None) if callable(member) else None
            if code is not None:
                yield code
