"""Which causal LMs the stream engine trains exactly: :func:`classify` one model type of the installed transformers.

Each model is a tiny random float64 build (:mod:`zoo`), compared with plain autograd on the model's own ``labels=``
loss (:func:`own_loss`: the labels paired with the logits as the model pairs them) on a batch of 2 x 23 tokens (labels
-100 on padding and a prompt), right and left padded, in chunks of :data:`CHUNK` tokens (which do not divide 23). The
bound is :data:`EXACT` relative, or :data:`FLOAT32_INTERNAL` where the model's own layer code computes in float32
inside the float64 model (norms, routers, sinks upcast to float32): the streamed backward then sums the same float32
terms in another order. That reason is not taken on trust: the float32 arithmetic in the layers is detected
(:func:`float32_ops_in_layers`) and the looser bound used only then. Where the float32 terms are amplified past that
bound (the exponentials of a gated recurrence, summed over chunk boundaries in another order), on the padded batches or
the packed row, both runs are repeated with the float32 arithmetic done in float64 (:class:`Float64Internals`) and held
to :data:`EXACT`: how far the float32 rounding goes depends on the CPU's float32 kernels, so it decides which float32
verdict a model gets, never whether it is exact.

``tests/test_every_causal_lm.py`` holds every model type to the status recorded for the installed transformers in
``tests/causal_lm_support/transformers-X.Y.json`` (:func:`support_table`), which ``scripts/model_support.py`` writes
from :func:`classify`, one file per tested release.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from unittest import mock

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_layers import GradientCheckpointingLayer
from zoo import VOCAB, batch, tiny_causal_lm

from streambp_trl import enable_streambp

EXACT, FLOAT32_INTERNAL = 1e-10, 1e-5
CHUNK = 5
SUPPORT_TABLES = Path(__file__).with_name("causal_lm_support")  # one file per tested transformers release


def support_table_path(version: str | None = None) -> Path:
    """The support table of transformers ``version`` (default: the installed one), by its release ``X.Y``."""
    release = ".".join((version or transformers.__version__).split(".")[:2])
    return SUPPORT_TABLES / f"transformers-{release}.json"


def support_table(version: str | None = None) -> dict:
    """The status of each model type as recorded for transformers ``version`` (default: the installed one); empty
    where that release has no table (:func:`support_table_path`)."""
    path = support_table_path(version)
    return json.loads(path.read_text()) if path.exists() else {}


def streamed_here(model_type: str) -> bool:
    """Whether the engine streams ``model_type`` on the installed transformers, as its support table records (a
    family can change between releases: transformers 5.24's Inkling 2 passes block states between its layers)."""
    return support_table().get(model_type, {}).get("status", "refused") != "refused"


# Models that cannot be built or run at all here, with the reason; each is still covered where it can be.
NOT_BUILDABLE = {
    "gemma3n": "its vision tower needs timm, pillow and torchvision, which this CPU setup does not install; its text "
    "decoder is the gemma3n_text case",
}
# Packed rows no plain CPU run can give the model's result for, and why
PACKED_NOT_COMPARED = {
    "granitemoehybrid": "with SDPA or eager attention, its Mamba kernels keep the documents apart (on CUDA; their "
    "CPU fallbacks refuse packed rows) while its attention mask, built without the position ids, does not (with "
    "flash attention both keep them apart: exact against each document alone, tests/test_packed_rows.py)",
}
# transformers' own float64 forward gives NaN on padded batches of these models (eager attention with sinks, or
# with logit softcapping); they are compared unpadded.
UNPADDED = {"granite_swa", "granitemoe_swa", "gemma2", "vaultgemma"}
# transformers' own float64 backward gives NaN gradients on left-padded batches of these; they are compared
# right-padded
RIGHT_PADDED = {"gemma3n_text"}


class _Float32InLayers(TorchDispatchMode):
    """Records whether any op inside a decoder layer produces a float32 tensor."""

    def __init__(self):
        super().__init__()
        self.depth, self.seen = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.seen.add(str(func))
        return out


def float32_ops_in_layers(model, ids, mask) -> set[str]:
    """The ops inside ``model``'s decoder layers that produce a float32 tensor in one no-grad forward."""
    recorder = _Float32InLayers()

    def enter(*_):
        recorder.depth += 1

    def leave(*_):
        recorder.depth -= 1

    hooks = []
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with recorder, torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return recorder.seen


class Float64Internals(TorchDispatchMode):
    """Every op asked for a float32 result (a cast such as ``.float()``, a factory with ``dtype=torch.float32``)
    computes in float64 instead, so a float64 model's float32 internals run in float64: under this mode the plain and
    the streamed run compute the same math without float32 rounding, and must agree to :data:`EXACT`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMS norm, ``weight * x / sqrt(mean(x^2) + eps)``, in the input's dtype (no float32 round trip)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def norms_in_model_dtype():
    """Qwen3's and Mistral's RMS norms computed in the model's dtype, for comparisons with compiled layers: the
    models' own norms round to float32 inside a float64 model, and a compiled norm rounds there differently from an
    eager one (about 4e-7 relative in the gradients), which would hide nothing of the engine but the comparison's
    precision (:class:`Float64Internals` does not reach compiled kernels)."""
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    with (
        mock.patch.object(Qwen3RMSNorm, "forward", _rms_norm_in_input_dtype),
        mock.patch.object(MistralRMSNorm, "forward", _rms_norm_in_input_dtype),
    ):
        torch._dynamo.reset()  # no graph compiled with the models' own norms is reused
        yield
    torch._dynamo.reset()


def own_loss(model, **inputs) -> torch.Tensor:
    """Plain autograd (``model`` not streamed): the model's own ``labels=`` loss, as its forward computes it from the
    full logits, pairing labels and logits as it does (transformers' causal-LM loss shifts the labels; the decoders of
    BART and the other encoder-decoder families do not), never a loss the test writes. Its loss function's float32
    upcast (``logits.float()`` in transformers' ``ForCausalLMLoss``, which in a float64 model rounds the logits to
    float32) computes in float64 (:class:`Float64Internals`), as the float64 model does everything else.
    ``use_cache=False`` unless ``inputs`` say otherwise."""
    function = model.loss_function

    def in_float64(*args, **kwargs):
        with Float64Internals():
            return function(*args, **kwargs)

    with mock.patch.object(model, "_loss_function", in_float64, create=True):  # what model.loss_function returns
        return model(**{"use_cache": False, **inputs}).loss


def plain_loss(model, ids, mask, labels) -> torch.Tensor:
    """Plain autograd on one batch: the model's own loss (:func:`own_loss`)."""
    return own_loss(model, input_ids=ids, attention_mask=mask, labels=labels)


PACKED_LENGTHS = (7, 1, 9, 6)  # the documents of a packed row: 23 tokens, a one-token document among them


def packed_row(lengths: tuple[int, ...] = PACKED_LENGTHS, seed: int = 3) -> tuple[list[torch.Tensor], dict]:
    """The documents, and one packed row of them as TRL's padding-free collator builds it: position ids that
    restart, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``, and labels (-100 at each document's first token,
    which nothing before it in its document predicts); and ``use_cache=False``, as TRL's trainers call the model (a
    call that builds a cache turns off transformers' packed-row detection, and attends across the documents)."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (1, n), generator=generator) for n in lengths]
    ids = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    inputs = dict(
        input_ids=ids,
        position_ids=positions,
        labels=ids.masked_fill(positions == 0, -100),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        seq_idx=seq_idx,
        use_cache=False,
    )
    return docs, inputs


def each_document_alone(model, docs: list[torch.Tensor]) -> torch.Tensor:
    """Plain autograd over the documents, each run as its own sequence and labelled as in :func:`packed_row` (-100 at
    its first token): the mean of the model's own loss (:func:`own_loss`) of each, weighted by its labels that are
    not -100 (the tokens it averages over, whether the model shifts the labels or not: the first label is -100)."""
    total, count = 0.0, 0
    for doc in docs:
        labels = doc.clone()
        labels[:, 0] = -100
        scored = int((labels != -100).sum())
        if scored:
            total = total + own_loss(model, input_ids=doc, labels=labels) * scored
            count += scored
    return total / count


def relative_errors(reference, streamed) -> tuple[float, str]:
    """Worst relative gradient error; a parameter whose true gradient is ~0 (e.g. a key bias, which softmax
    ignores) is measured against 1e-8 of the largest gradient norm instead of its own."""
    grads = dict(streamed.named_parameters())
    norms = {n: p.grad.norm() for n, p in reference.named_parameters() if p.grad is not None}
    floor = 1e-8 * max(norms.values())
    worst, where = 0.0, ""
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        q = grads[name].grad
        assert q is not None, f"{name} got no gradient"
        err = ((p.grad - q).norm() / torch.maximum(norms[name], floor)).item()
        if not err <= worst:
            worst, where = err, name
    return worst, where


def classify(model_type: str) -> dict:
    """Build the tiny model, enable the engine, and compare with plain autograd.

    Returns ``{"class", "status", ...}``: status ``"refused"`` (with ``reason``, the refusal's text after the model
    name), ``"exact"`` (``bound`` 1e-10), ``"exact, float32 internals"`` (``bound`` 1e-5) or ``"exact, float32
    internals in float64"`` (``bound`` 1e-10 under :class:`Float64Internals`), or ``"inexact"`` (with the error): the
    last is always a failure. The first of these verdicts whose bound both the padded batches and the packed row
    (:func:`_packed_rows`) meet is the model's; the float32 ones only where the layers compute in float32. So whether
    the float32 rounding of another summation order stays under 1e-5, which depends on the CPU's float32 kernels,
    decides only which of the two float32 verdicts a model gets, never whether it is exact: past 1e-5, its float32
    internals run in float64, and the model is held to 1e-10.
    """
    reference = tiny_causal_lm(model_type)
    name = type(reference).__name__
    result = {"class": name}
    streamed = copy.deepcopy(reference)
    try:
        enable_streambp(streamed, stream_chunk_size=CHUNK, logits_chunk_size=7)
    except ValueError as error:
        message = str(error)
        assert message.startswith(f"StreamBP cannot train {name} exactly: "), message
        reason = message.split(" exactly: ", 1)[1]
        return {**result, "status": "refused", "reason": reason.split(" (")[0].rstrip(".")}
    paddings = ("none",) if model_type in UNPADDED else ("right",) if model_type in RIGHT_PADDED else ("right", "left")
    float32_ops = set().union(*(float32_ops_in_layers(reference, *batch(padding=p)[:2]) for p in paddings))
    verdicts = [("exact", EXACT, contextlib.nullcontext)]
    if float32_ops:
        verdicts += [
            ("exact, float32 internals", FLOAT32_INTERNAL, contextlib.nullcontext),
            ("exact, float32 internals in float64", EXACT, Float64Internals),
        ]
    padded, packed = {}, {}  # by mode: each comparison runs once
    first = None  # the first verdict the padded batches meet, with its packed row's result
    for status, bound, mode in verdicts:
        if mode not in padded:
            padded[mode] = _worst_error(reference, streamed, paddings, mode)
        if padded[mode][0] > bound:
            continue
        if mode not in packed:
            packed[mode] = _packed_rows(model_type, reference, streamed, mode)
        row = packed[mode]
        row = row if "packed_error" not in row else _packed_verdict(row["packed_error"], bound)
        first = first or {**result, "status": status, "bound": bound, **row}
        if row["packed"] != "inexact":
            return {**result, "status": status, "bound": bound, **row}
    if first is not None:  # the padded batches are exact, the packed row is not
        return first
    worst, where = padded[contextlib.nullcontext]
    return {**result, "status": "inexact", "error": worst, "where": where, "float32_ops": sorted(float32_ops)}


def _packed_verdict(error: float, bound: float) -> dict:
    return {"packed": "exact"} if error <= bound else {"packed": "inexact", "packed_error": error}


def _packed_rows(model_type: str, reference, streamed, mode) -> dict:
    """The streamed model on one packed row (:func:`packed_row`) against the plain model on the same row, or against
    each document run alone where transformers refuses the row on the CPU (a recurrent mixer hands the descriptors to
    a kernel whose torch fallback cannot keep the documents apart: on CUDA that kernel does), both under ``mode()``:
    ``{"packed_error": e}``, the larger relative error of the loss and the gradients; or ``{"packed": "refused"}``
    (with ``packed_reason``) where the engine refuses the row, ``{"packed": "not compared"}`` (with the reason) where
    no plain CPU run gives the model's result."""
    if model_type in PACKED_NOT_COMPARED:
        return {"packed": "not compared", "packed_reason": PACKED_NOT_COMPARED[model_type]}
    docs, inputs = packed_row()
    labels = inputs.pop("labels")
    reference.zero_grad()
    streamed.zero_grad()
    with mode():
        try:
            ref_loss = own_loss(reference, **inputs, labels=labels)
        except ValueError as error:
            if "packed sequences apart" not in str(error):
                raise
            reference.zero_grad()
            ref_loss = each_document_alone(reference, docs)
        ref_loss.backward()
        try:
            loss = streamed(**inputs, labels=labels).loss
        except ValueError as error:
            if not str(error).startswith("StreamBP"):
                raise
            reason = str(error).partition(": ")[2] or str(error)
            return {"packed": "refused", "packed_reason": reason.split(" (")[0].rstrip(".")}
        loss.backward()
    loss_error = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return {"packed_error": max(loss_error, relative_errors(reference, streamed)[0])}


def streamed_error(reference, streamed, ids, mask, labels, mode=contextlib.nullcontext) -> tuple[float, str]:
    """The larger of the relative loss error and the worst relative gradient error of ``streamed`` against plain
    autograd on one batch (:func:`streamed_errors`), and the parameter where the gradient error is worst."""
    loss_err, grad_err, at = streamed_errors(reference, streamed, ids, mask, labels, mode)
    return max(loss_err, grad_err), at


def streamed_errors(reference, streamed, ids, mask, labels, mode=contextlib.nullcontext) -> tuple[float, float, str]:
    """The relative loss error, the worst relative gradient error of ``streamed`` against plain autograd on one batch
    (gradients zeroed first, both runs under ``mode()``) and the parameter where the gradient error is worst."""
    reference.zero_grad()
    streamed.zero_grad()
    with mode():
        ref_loss = plain_loss(reference, ids, mask, labels)
        ref_loss.backward()
        loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    assert torch.isfinite(ref_loss), f"{type(reference).__name__}: plain transformers gives {ref_loss.item()}"
    grad_err, at = relative_errors(reference, streamed)
    return abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), grad_err, at


def _worst_error(reference, streamed, paddings, mode) -> tuple[float, str]:
    """The worst :func:`streamed_error` over ``paddings``."""
    return max((streamed_error(reference, streamed, *batch(padding=p), mode) for p in paddings), key=lambda r: r[0])
