"""The check ``enable_streambp`` runs on the model itself: a short input through the model's own path and through the
stream engine must agree, so a model the engine cannot run exactly is refused before training, not at step one.

It catches what no list of known architectures can: an LM head that transforms hidden states before its output
projection, attention code that reads the mask tensor itself, token mixing outside attention, layer arguments the
engine cannot split. It costs two short forward passes (batch 2, 11 tokens, one row left-padded) under no grad, on
the model's device and dtype, with the global random state and every module's state (buffers, attributes) left as it
was. Models whose weights are not materialised and whole in this process (meta tensors, ZeRO-3 partitions, FSDP2
DTensor shards) are not probed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..layers.traits import names_called
from ..patching import bypassed

PROBE_TOKENS = 11
PROBE_CHUNK = 4  # several chunks, the last one shorter
_PADDING = 3
# relative difference allowed between the model's own forward and the streamed one, by parameter dtype
_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3}
_LOW_PRECISION_TOLERANCE = 5e-2


@dataclasses.dataclass
class ProbeBaseline:
    """The model's own results on the probe input, taken before the engine is installed."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden: torch.Tensor  # the decoder's last hidden state, training mode, randomness off
    random: bool  # the decoder's training-mode output still changes with the seed: compare nothing
    norm_last: bool = False  # the given final norm is the decoder's last step: the logit kernel may apply it


def _probe_able(lm: nn.Module) -> bool:
    """Whether the probe can run ``lm`` as it is, in this process alone: every parameter materialised and whole.

    Not probed: meta tensors; ZeRO-3 partitions (empty until DeepSpeed gathers them); DTensor parameters (FSDP2's
    ``fully_shard``, tensor parallelism), which only the sharded modules' own hooks make whole, with collectives.
    The probe calls the decoder and the head directly, and ``enable_streambp`` may run on one rank at a time (the
    DPO reference model is sharded inside TRL's constructor), so probing through the root would issue collectives
    that the other ranks never join. A sharded model is the same architecture as the unsharded one, which the
    probe checks in a one-process run; the trainers' distributed tests check it sharded.
    """
    from torch.distributed.tensor import DTensor

    return all(not p.is_meta and p.numel() > 0 and not isinstance(p, DTensor) for p in lm.parameters())


@contextmanager
def _quiet(lm: nn.Module, streaming_decoder: nn.Module | None = None) -> Iterator[None]:
    """Every module in eval mode (so dropout, jitter and sampled routing are off), except, if given, the decoder and
    its layers, whose training mode is what makes them stream; no grad; the random state and every module's state
    restored afterwards (:func:`_kept`)."""
    with _kept(lm):
        lm.eval()
        if streaming_decoder is not None:
            streaming_decoder.training = True
            for m in streaming_decoder.modules():
                if isinstance(m, GradientCheckpointingLayer):
                    m.training = True
        device = _device(lm)
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]), torch.no_grad():
            yield


@contextmanager
def _kept(lm: nn.Module) -> Iterator[None]:
    """Every module of ``lm`` left as it was: its attributes (the same objects) and the attributes of the objects among
    them (one level down: :func:`_objects`), the contents of the containers among them (its buffers, parameters,
    submodules, hooks), the values of its tensors (buffers and plain tensor attributes), and each parameter's data
    and attributes (the same way).

    A module may change its own state in a forward: a dynamic rotary embedding (transformers'
    ``dynamic_rope_update``) sets new frequencies (``inv_freq``, ``max_seq_len_cached``, ``attention_scaling``) for
    the longest sequence it has seen, and resets them on a short one, as the probe's is; bitsandbytes' 8-bit layer
    updates its matmul state object. A layer may also re-lay its own weights in a forward that needs no gradient:
    bitsandbytes' 4-bit linear layer, in eval mode on a CPU with AVX512-BF16, replaces its weight's data with a
    layout for an inference kernel and rewrites its ``quant_state`` in place (block scales rounded to bfloat16, a
    packing flag set); a later training forward then takes that kernel, which has no backward, and no gradient
    reaches the layer's input (the LoRA gradients of every layer below it go wrong while the loss stays the same).
    The probe runs every such layer in eval mode without grad, so the model must compute after the probe what it
    computed before. Holds a copy of every buffer and tensor attribute while it runs, and references to the
    parameters' data (a re-laid weight's old data stays alive beside its new one)."""
    saved = []
    for m in lm.modules():
        attributes = dict(vars(m))
        contents = {k: v.copy() for k, v in attributes.items() if isinstance(v, (dict, set))}
        tensors = [t for t in attributes.values() if isinstance(t, torch.Tensor)]
        tensors += [t for t in m._buffers.values() if t is not None]
        saved.append((m, attributes, contents, [(t, t.detach().clone()) for t in tensors], _objects(attributes)))
    parameters = [(p, p.data, dict(vars(p)), _objects(vars(p))) for p in lm.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, attributes, contents, tensors, objects in saved:
                vars(m).clear()
                vars(m).update(attributes)
                for k, copy in contents.items():
                    attributes[k].clear()
                    attributes[k].update(copy)
                for t, copy in tensors:
                    t.copy_(copy)
                _restore(objects)
            for p, data, attributes, objects in parameters:
                p.data = data
                _restore([(p, attributes), *objects])


def _objects(attributes: dict) -> list[tuple[object, dict]]:
    """The objects among ``attributes`` that hold state in their ``__dict__`` (a quantization state, a matmul
    state, a config), not tensors, modules, Python modules, enum members, classes or functions, each with a shallow
    copy of its ``__dict__`` (its attributes, the same objects)."""
    return [
        (v, dict(vars(v)))
        for v in attributes.values()
        if hasattr(v, "__dict__")
        and not isinstance(v, (torch.Tensor, nn.Module, type, types.ModuleType, enum.Enum))
        and not callable(v)
    ]


def _restore(objects: list[tuple[object, dict]]) -> None:
    """Each object's attributes as they were: those added since removed, those changed put back (the same
    objects), the others untouched."""
    for v, contents in objects:
        state = vars(v)
        for key in [k for k in state if k not in contents]:
            del state[key]
        for key, value in contents.items():
            if state.get(key, contents) is not value:
                state[key] = value


def _device(lm: nn.Module) -> torch.device:
    return lm.get_input_embeddings().weight.device


def _dtype(lm: nn.Module) -> torch.dtype:
    return next((p.dtype for p in lm.parameters() if p.is_floating_point()), torch.float32)


def _relative_difference(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    a, b = a[valid].double(), b[valid].double()
    finite = torch.isfinite(b).all(-1) & torch.isfinite(a).all(-1)
    a, b = a[finite], b[finite]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else math.inf


def _tolerance(lm: nn.Module) -> float:
    return _TOLERANCE.get(_dtype(lm), _LOW_PRECISION_TOLERANCE)


def _hidden(decoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return decoder(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=True).last_hidden_state


def check_weights(lm: PreTrainedModel, layers: list[nn.Module], refuse: Callable[[str], None]) -> None:
    """Refuse weights whose values make the model's own result depend on a sort's tie order over whole rows, which a
    chunk cannot reproduce: a dynamic mask attention (Doge's ``prepare_dynamic_mask``) whose per-head decay ``A`` is
    exactly 0 in a head gives every key of that head the bias ``exp(0 * dt) = 1``, so its top-k window keeps the
    keys the sort happens to put first. Checked with the probe (``verify=True``: it reads the weights' values), where
    they are materialised and whole."""
    if not _probe_able(lm):
        return
    for layer in layers:
        for module in layer.modules():
            a = getattr(module, "A", None)
            if "prepare_dynamic_mask" in names_called(type(module)) and isinstance(a, torch.Tensor) and (a == 0).any():
                refuse(
                    f"its dynamic mask attention ({type(module).__name__}) has A = 0 in a head, which gives every "
                    "key the same bias (exp(0 * dt) = 1): which keys its top-k window (keep_window_size="
                    f"{getattr(module, 'keep_window_size', '?')}) keeps among them is then the sort's tie order over "
                    "the whole row, which a chunk cannot reproduce; load trained weights (the released checkpoints "
                    "have A != 0) or initialise A with nonzero values (e.g. torch.nn.init.normal_)"
                )


def baseline(
    lm: PreTrainedModel,
    decoder: PreTrainedModel,
    head_logits: Callable[[torch.Tensor], torch.Tensor] | None,
    refuse: Callable[[str], None],
    final_norm: nn.Module | None = None,
) -> ProbeBaseline | None:
    """Run the probe input through the unmodified model; refuse a head the logit kernel does not reproduce
    (``head_logits``: the logits the kernel would compute from the decoder's output; ``None`` for a model whose head
    is applied as the model applies it, e.g. a sequence classifier's score head, which has no logits to check).

    With ``final_norm``, also tell whether the decoder's output is ``final_norm`` applied to what the decoder returns
    when that module is bypassed (so the logit kernel, or the score head's rows, can take it instead).
    """
    if not _probe_able(lm):
        return None
    device = _device(lm)
    vocab = (lm.get_output_embeddings() if head_logits is not None else lm.get_input_embeddings()).weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, PROBE_TOKENS), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :_PADDING] = 0
    valid = mask.bool()
    try:
        with _quiet(lm):
            post = _hidden(decoder, ids, mask)
            if head_logits is not None:
                logits = lm(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=True).logits
                own = head_logits(post)
            if final_norm is not None:
                with bypassed(final_norm):
                    pre = _hidden(decoder, ids, mask)
                norm_last = _relative_difference(final_norm(pre), post, valid) <= _tolerance(lm)
        with _quiet(lm, decoder):
            hidden = _hidden(decoder, ids, mask)
        with _quiet(lm, decoder):
            torch.manual_seed(1)
            random = not torch.equal(hidden, _hidden(decoder, ids, mask))
    except Exception as error:  # any failure of the model's own forward is the reason to refuse
        refuse(
            f"its own forward does not run on input_ids and an attention mask alone ({type(error).__name__}: {error})"
        )
    if head_logits is None:
        return ProbeBaseline(ids, mask, hidden, random, final_norm is not None and norm_last)
    if logits is None or logits.shape[:2] != ids.shape:
        refuse("its forward returns no per-token logits")
    diff = _relative_difference(own, logits.to(own.dtype), valid)
    if not diff <= _tolerance(lm):
        refuse(
            "its logits are not a linear LM head of the decoder's last hidden state (the model transforms the hidden "
            f"states before the output projection; relative difference {diff:.1e})"
        )
    return ProbeBaseline(ids, mask, hidden, random, final_norm is not None and norm_last)


def check_streamed(
    lm: PreTrainedModel,
    decoder: PreTrainedModel,
    ref: ProbeBaseline,
    streamed: Callable[[tuple, dict], object],
    refuse: Callable[[str], None],
) -> None:
    """Run the probe input through ``streamed`` (a streamed decoder call in chunks of ``PROBE_CHUNK``, taking the
    call's positional and keyword arguments) and compare with ``ref``."""
    inputs = {
        "input_ids": ref.input_ids,
        "attention_mask": ref.attention_mask,
        "use_cache": False,
        "return_dict": True,
    }
    try:
        with _quiet(lm, decoder):
            hidden = streamed((), inputs).last_hidden_state
    except Exception as error:  # any failure of the streamed forward is the reason to refuse
        refuse(f"its layers fail when streamed chunk by chunk ({type(error).__name__}: {error})")
    if ref.random:
        return
    diff = _relative_difference(hidden, ref.hidden, ref.attention_mask.bool())
    if not diff <= _tolerance(lm):
        refuse(
            "its layers give a different result when streamed chunk by chunk (relative difference "
            f"{diff:.1e}): they mix tokens outside what a chunk receives from the earlier ones through the cache (the "
            "keys/values, or the recurrent and convolution states), e.g. a scan that always starts from a zero state"
        )
