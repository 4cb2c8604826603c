"""``torch.compile`` for a decoder layer's per-chunk body; the chunk loop, the key/value cache and the attention stay
eager, as chunked-loss kernels compile their per-chunk function and not their loop.

What is compiled is the layer's own forward, ``type(layer).forward``, once per layer class and compile setting
(:func:`compiled_forward`), on one chunk at a time, so its shapes are the chunk's: (batch, chunk, hidden), the last
chunk of a call shorter. The engine's objects the layer's code calls (the chunk cache, its compressed-attention
states, the shared keys/values, the streamed attention function) are opaque to the compiler
(:func:`~streambp_trl.patching.opaque_methods`, ``torch.compiler.disable``): dynamo breaks its graph there and runs
them eagerly, so the prefix's growing keys/values, a chunk's position and the cache's state never enter a graph and
cause no recompile. A dense layer thus compiles into a few graphs between those breaks (dynamo also breaks where the
layer's forward calls its attention module), for each kind of run: the forward without grad, the recompute with
grad, the collecting pass (no queries), a shorter last chunk. Every layer of a class shares them:
a layer's integer attributes (``layer_idx``) are graph inputs, not constants (dynamo's
``allow_unspec_int_on_nn_module``), and its parameters are inputs as well. A code object may hold up to 32 variants
(``recompile_limit``, 8 by default; transformers' ``deprecate_kwarg`` wrapper is one code object for every layer
class it decorates); past that dynamo runs it eagerly, with its warning.

Exact as eager is: each graph computes the layer's own operations. Random operations in a graph draw from PyTorch's
generator as eager ones do, in the program's order (inductor's ``fallback_random``, with ``reorder_for_peak_memory``
off), so the random state replayed for every recompute of a chunk gives it the forward's dropout masks. Where the
compiler fuses a computation whose intermediate rounding the model's code fixes (a norm computed in float32 inside a
float64 or bfloat16 model), the result may differ from eager in the last bits of that precision, as with
``torch.compile`` of the whole model.

A graph the backend fails to compile, forward or backward (the backward is compiled with the forward,
``force_non_lazy_backward_lowering``), runs eagerly, with one warning naming the layer class and the error
(:func:`_graph_compiler`); so does a frame dynamo fails to trace (its ``suppress_errors``; its warning made one line,
:class:`_OneLine`); each failure is warned about once. What dynamo does not trace (a graph break) it runs eagerly
itself, with its own warning where it gives one. CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``, the
``cudagraphs`` backend) are refused where the options are read (:func:`check_compile`): the next replay of a captured
graph overwrites the outputs of the previous one, which the streamed layer still holds (each chunk's output, its
saved graph). Memory: the chunk's activations, as eager (the compiler may keep fewer intermediates for backward).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)
_RUNNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("streambp_compiled_layer", default=None)

# modes whose graphs replay as CUDA graphs (torch._inductor.list_mode_options)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclasses.dataclass(frozen=True)
class LayerCompile:
    """How a streamed layer's per-chunk body is compiled: ``torch.compile``'s ``backend`` (a dynamo backend name) and,
    for inductor, its ``mode`` (``None``: the default), as TrainingArguments' ``torch_compile_backend`` and
    ``torch_compile_mode`` name them."""

    backend: str = "inductor"
    mode: str | None = None


def check_compile(backend: str | None, mode: str | None) -> None:
    """Refuse a compile setting the streamed layers cannot run: CUDA graphs (this module's docstring says why), a mode
    inductor does not know, a mode given to another backend (modes are inductor's)."""
    if mode in CUDA_GRAPH_MODES or backend == "cudagraphs":
        said = f"torch_compile_mode={mode!r}" if mode in CUDA_GRAPH_MODES else "torch_compile_backend='cudagraphs'"
        raise ValueError(
            f"{said} replays the compiled graphs as CUDA graphs, whose next replay overwrites the outputs the "
            "streamed layers still hold: use torch_compile_mode='max-autotune-no-cudagraphs' or leave it unset "
            "(inductor's default), with the inductor backend."
        )
    if mode is not None and backend not in (None, "inductor"):
        raise ValueError(
            f"torch_compile_mode={mode!r} is a mode of the inductor backend, not of "
            f"torch_compile_backend={backend!r}: leave one of them unset."
        )
    if mode is not None:
        from torch._inductor import list_mode_options

        try:
            list_mode_options(mode)
        except RuntimeError as error:
            raise ValueError(f"torch_compile_mode={mode!r} is not a mode of inductor: {error}") from None


@functools.cache
def compiled_forward(forward: Callable, spec: LayerCompile) -> Callable:
    """``forward`` (a layer class's own forward, ``forward(layer, x, **kwargs)``) compiled by ``spec``: one compiled
    function per (forward, spec), shared by every layer of the class (this module's docstring)."""
    where = getattr(forward, "__qualname__", repr(forward)).rsplit(".", 1)[0]
    compiled = torch.compile(forward, backend=_graph_compiler(spec, where), dynamic=None)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        running = _RUNNING.set(where)
        try:
            with (
                torch._dynamo.config.patch(
                    allow_unspec_int_on_nn_module=True, suppress_errors=True, recompile_limit=32
                ),
                torch._inductor.config.patch(fallback_random=True, reorder_for_peak_memory=False),
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
            ):
                return compiled(*args, **kwargs)
        finally:
            _RUNNING.reset(running)

    return run


class _OneLine(logging.Filter):
    """dynamo's warning for a frame it failed to trace and runs eagerly (``suppress_errors``: "WON'T CONVERT", with
    its traceback), in one line naming the layer class, where the frame is a compiled layer's."""

    def filter(self, record: logging.LogRecord) -> bool:
        where = _RUNNING.get()
        if where is not None and record.getMessage().startswith("WON'T CONVERT"):
            error = record.exc_info[1] if record.exc_info else None
            said = _first_line(error) if error is not None else record.getMessage().splitlines()[0]
            record.msg = (
                f"StreamBP: torch.compile failed to trace a part of {where}'s forward, which runs eagerly: {said}"
            )
            record.args, record.exc_info, record.exc_text = (), None, None
            return _first_time(record.msg)
        return True


logging.getLogger("torch._dynamo.convert_frame").addFilter(_OneLine())


def _graph_compiler(spec: LayerCompile, where: str) -> Callable:
    """The backend dynamo hands each captured graph of ``where`` (a layer class): ``spec``'s, or, where that fails,
    the graph itself, run eagerly, with one warning."""

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        try:
            if spec.backend == "inductor":
                from torch._inductor import list_mode_options
                from torch._inductor.compile_fx import compile_fx

                patches = list_mode_options(spec.mode) if spec.mode is not None else {}  # (None lists every mode)
                return compile_fx(graph, example_inputs, config_patches=patches)
            return torch._dynamo.lookup_backend(spec.backend)(graph, example_inputs)
        except Exception as error:  # noqa: BLE001 (any compiler failure: the graph runs eagerly)
            said = (
                f"StreamBP: torch.compile (backend {spec.backend!r}) failed on a part of {where}'s forward, which "
                f"runs eagerly: {_first_line(error)}"
            )
            if _first_time(said):
                logger.warning(said)
            return graph.forward

    return compile_graph


def _first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message."""
    return f"{type(error).__name__}: {next(iter(str(error).strip().splitlines()), '')}"


_SAID: set[str] = set()


def _first_time(message: str) -> bool:
    """Whether ``message`` is said for the first time in this process (each failure is warned about once)."""
    new = message not in _SAID
    _SAID.add(message)
    return new
