"""One streamed forward/backward of a tiny float64 model whose sequences are split across processes, for
tests/test_sequence_split.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/sequence_split_step.py --family qwen3 --out F [...]

Every rank builds the same model and batch (2 rows of ``--per-rank`` x world tokens). Rank q streams positions
[q L, (q + 1) L) of each row (``sequence_group`` = the world) with its share of ``shift_labels`` and the whole batch's
token count, so the sum of the ranks' losses is the whole sequence's mean loss; the ranks' gradients are summed by an
``all_reduce``. Each rank also runs plain autograd (no engine) on the whole rows, and rank 0 writes both losses, the
largest relative gradient error and where, and the collectives the split issued, to ``--out``.

Both run under :class:`~model_support.Float64Internals`: the norms' float32 upcasts (RMSNorm's ``.to(float32)``)
compute in float64. Otherwise they round the key path's gradient to float32 in backward, and the split, which sends
the later ranks' part of a key's gradient through the norm apart from the rank's own part (their sum is the same
gradient), rounds it differently from plain autograd: ~1e-7 relative, the float32 rounding of the model itself.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_support import Float64Internals, norms_in_model_dtype  # noqa: E402
from models import VOCAB, tiny_model  # noqa: E402

from streambp_trl import enable_streambp  # noqa: E402

COUNTED = ("all_gather", "batch_isend_irecv")


def split_loss(model, ids, shift, tokens: int, rank: int) -> torch.Tensor:
    """The whole rows' loss, from each rank's share (a copy of the model made before the training step, seeded alike,
    draws that step's dropout masks)."""
    torch.manual_seed(100 + rank)
    with Float64Internals():
        loss = model(input_ids=ids, shift_labels=shift, num_items_in_batch=tokens).loss.detach()
    dist.all_reduce(loss)
    return loss


def directional(model, pristine, loss_of, eps: float = 1e-5) -> dict:
    """The gradient (already summed over the ranks) along a random direction v, against the derivative of the loss
    the forward returns along v, its dropout masks drawn alike each time (each loss from a copy of ``pristine``, the
    model before its step): central differences D(h) = (L(θ + hv) - L(θ - hv)) / 2h at h = ε and ε/2, extrapolated as
    (4 D(ε/2) - D(ε)) / 3, which cancels their h² error (a float64 accuracy of ~1e-10 at ε = 1e-5)."""
    g = torch.Generator().manual_seed(3)
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    grads = dict(model.named_parameters())
    direction = [torch.randn(grads[n].shape, generator=g, dtype=grads[n].dtype) for n in names]
    along = sum((grads[n].grad * v).sum() for n, v in zip(names, direction, strict=True)).item()

    def at(h: float) -> float:
        copy_ = copy.deepcopy(pristine)
        params = dict(copy_.named_parameters())
        with torch.no_grad():
            for n, v in zip(names, direction, strict=True):
                params[n].add_(h * v)
        return loss_of(copy_).item()

    def central(h: float) -> float:
        return (at(h) - at(-h)) / (2 * h)

    return {"along": along, "difference": (4 * central(eps / 2) - central(eps)) / 3}


def whole(args, model, reference, ids, rows: dict, labels, world: int, counts: dict, internals) -> None:
    """Every rank given the whole rows (``rows``: their attention mask, or packed rows' position ids): the loss (the
    same on every rank) and the gradients averaged over the ranks against plain autograd on the whole rows; rank 0
    writes them to ``--out`` and the processes exit."""

    if args.whole_rows == "score":  # the second row's last tokens are padding: its score is read before them
        ids[1, -4:] = 0

    def loss_of(model, streamed: bool) -> torch.Tensor:
        if args.whole_rows == "score":
            scores = model(input_ids=ids, attention_mask=(ids != 0).long()).logits[:, 0]
            return -F.logsigmoid(scores[0] - scores[1])
        if args.whole_rows == "nll":
            if streamed:
                return model(input_ids=ids, **rows, labels=labels).loss
            logits = model(input_ids=ids, **rows).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        if streamed:
            per_token = model(input_ids=ids, **rows, labels=labels, fused_lm_head=True).log_probs
        else:
            logits = model(input_ids=ids, **rows).logits[:, :-1]
            target = labels[:, 1:]
            picked = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
            per_token = picked * (target != -100)
        logps = per_token.sum(1)
        return -F.logsigmoid(0.5 * (logps[0] - logps[1]))

    with internals():
        loss = loss_of(model, True)
        loss.backward()
        ref = loss_of(reference, False)
        ref.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    worst, where = 0.0, ""
    grads = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        if not p.requires_grad:  # (QLoRA's frozen base weights)
            continue
        q = grads[name].grad
        err = float("inf") if q is None else ((p.grad - q).norm() / p.grad.norm().clamp_min(1e-300)).item()
        if err > worst:
            worst, where = err, name
    out = {"loss": loss.item(), "reference_loss": ref.item(), "error": worst, "where": where, "collectives": counts}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)


def flash_named(model):
    """``model`` with flash attention named as its attention implementation: the CPU has no flash kernel, but a
    streamed call never runs the model's own attention, and the engine keeps packed documents apart as flash's
    variable-length kernel does (:class:`~streambp_trl.layers.adapters.varlen.VarlenAttention`)."""
    from streambp_trl.attention import stream_configs

    for config in stream_configs(model):
        config._attn_implementation_internal = "flash_attention_2"
    return model


def refusals(rank: int) -> dict[str, str]:
    """What each input a sequence split does not serve raises (its message, or "accepted")."""
    from zoo import tiny_causal_lm

    group = dist.group.WORLD
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    shift = ids.roll(-1, dims=1)
    cases = {
        "hybrid": lambda: enable_streambp(tiny_causal_lm("qwen3_5_text"), stream_chunk_size=4, sequence_group=group),
    }
    model = enable_streambp(tiny_model("qwen3"), stream_chunk_size=4, sequence_group=group)
    dense = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    cases["4D mask"] = lambda: model(input_ids=ids, attention_mask=dense, shift_labels=shift).loss
    cases["labels"] = lambda: model(input_ids=ids, labels=ids).loss
    mine = ids[:, : 4 + 2 * rank]  # rank 0: 4 tokens, rank 1: 6
    cases["lengths"] = lambda: model(input_ids=mine, shift_labels=shift[:, : mine.shape[1]]).loss
    rows = ids[: 1 + rank]  # rank 0: one row, rank 1: two
    cases["rows"] = lambda: model(input_ids=rows, shift_labels=shift[: rows.shape[0]]).loss
    own = torch.arange(6 * rank, 6 * rank + 6).expand(2, -1)  # rank 0 gives its global positions, rank 1 none
    cases["positions"] = lambda: model(input_ids=ids, position_ids=own if rank == 0 else None, shift_labels=shift)
    padded = torch.ones_like(ids)
    padded[1, :2] = 0  # rank 0's share padded, rank 1's given no mask: its rows joined with all ones
    cases["a mask on one rank"] = lambda: float(
        model(input_ids=ids, attention_mask=padded if rank == 0 else None, shift_labels=shift).loss
    )
    starts = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])  # this rank's share of packed rows: restarts
    cuts = torch.tensor([0, 3, 6], dtype=torch.int32)
    cases["descriptors"] = lambda: model(input_ids=ids, position_ids=starts, cu_seq_lens_q=cuts, shift_labels=shift)
    # (use_cache=False: with a cache transformers' mask attends across a packed row's documents, and so does the split)
    cases["rows apart"] = lambda: model(input_ids=ids, position_ids=starts, shift_labels=shift, use_cache=False).loss
    chunked = enable_streambp(tiny_causal_lm("llama4_text"), stream_chunk_size=4, sequence_group=group)
    packed = starts[:1].expand(2, -1)
    flash = flash_named(tiny_model("qwen3"))
    enable_streambp(flash, stream_chunk_size=4, sequence_group=group, verify=False)
    ones = torch.ones_like(ids)
    cases["flash, a mask"] = lambda: flash(input_ids=ids, attention_mask=ones, position_ids=packed, shift_labels=shift)
    cases["chunked"] = lambda: chunked(input_ids=ids, position_ids=packed, shift_labels=shift, use_cache=False).loss
    said = {}
    for name, run in cases.items():
        try:
            run()
        except ValueError as e:
            said[name] = str(e)
        else:
            said[name] = "accepted"
    return said


def qlora_model():
    """tests/test_quantized.py's QLoRA model (bitsandbytes' 4-bit layers re-laid as on a CPU with AVX512-BF16)."""
    import bitsandbytes as bnb

    bnb.nn.modules.has_avx512bf16 = lambda: True
    from test_quantized import qlora_model as built

    return built()


def main() -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective shows where, instead of hanging the suite
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--per-rank", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--kv-mode", default="recompute")
    parser.add_argument("--keep-attention", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--padding", action="store_true", help="row 0 left-padded, row 1 right-padded, over ranks")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="packed rows, as TRL's padding-free batches come: position ids that restart where each document starts "
        "(within and at the ranks' shares), no attention mask",
    )
    parser.add_argument(
        "--cached", action="store_true", help="packed whole rows with use_cache left on: attended across the documents"
    )
    parser.add_argument("--flash", action="store_true", help="flash attention named as the streamed model's own")
    parser.add_argument("--refusals", action="store_true", help="write what each input the split refuses raises")
    parser.add_argument(
        "--whole-rows",
        choices=("nll", "pairs", "score"),
        help="every rank given the whole rows (enable_streambp(whole_rows=True)), one token short of a multiple of "
        "the ranks: the model's own labels= loss (nll), a preference loss over the rows' summed log-probs of "
        "fused_lm_head=True (pairs), or over a sequence classifier's scores, the second row ending in padding "
        "(score); the gradients averaged over the ranks",
    )
    parser.add_argument("--compile", action="store_true", help="torch_compile=True, the norms in the model's dtype")
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA in float32: the tiny checkpoint's NF4 base weights, LoRA on every linear layer (tests/"
        "test_quantized.py's qlora_model), against plain autograd on the same quantized model",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    held = contextlib.ExitStack()  # (held until the process's os._exit)
    if args.compile:  # compiled norms round their float32 differently: both sides compute them in float64
        held.enter_context(norms_in_model_dtype())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.refusals:
        said = refusals(rank)
        if rank == 0:
            Path(args.out).write_text(json.dumps(said))
        dist.barrier()
        os._exit(0)
    overrides = {"attention_dropout": args.dropout} if args.dropout else {}
    internals = contextlib.nullcontext if args.qlora else Float64Internals  # (float32: bitsandbytes has no float64)
    reference = qlora_model() if args.qlora else tiny_model(args.family, num_hidden_layers=3, **overrides)
    if args.whole_rows == "score":  # its *ForSequenceClassification (pad id 0), one score
        reference.config.num_labels = 1
        torch.manual_seed(0)
        reference = AutoModelForSequenceClassification.from_config(reference.config).double().train()
    model = qlora_model() if args.qlora else copy.deepcopy(reference)
    length = args.per_rank * world - (args.whole_rows is not None)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, min(VOCAB, reference.config.vocab_size), (2, length), generator=g)
    labels = ids.clone()
    labels[0, : length // 3] = -100  # a prompt without labels, crossing ranks
    mask = torch.ones_like(ids)
    if args.padding:  # each pad run longer than a rank's share
        pad = args.per_rank + 2
        mask[0, :pad], mask[1, -pad:] = 0, 0
        labels[mask == 0] = -100
    positions = None
    if args.packed:  # documents of 5, 1, 3, ... tokens: starts inside a share and at its first token, a one-token one
        lengths = [5, 1, 3, args.per_rank, length]
        positions = torch.cat([torch.arange(n) for n in lengths])[:length].expand(2, -1)
        labels[:, positions[0] == 0] = -100  # (as TRL's padding-free collator: no document's first token is scored)
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    tokens = int((shift != -100).sum())

    if args.flash:
        flash_named(model)
    enable_streambp(
        model,
        verify=not args.flash,
        stream_chunk_size=args.chunk,
        kv_mode=args.kv_mode,
        keep_activations=0,
        keep_attention=args.keep_attention,
        sequence_group=dist.group.WORLD,
        whole_rows=args.whole_rows is not None,
        torch_compile=args.compile,
    )
    pristine = copy.deepcopy(model)  # (before any step: its copies draw the first step's dropout masks)
    counts = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*a, _original=original, _name=name, **kw):
            counts[_name] += 1
            return _original(*a, **kw)

        setattr(dist, name, counted)
    mine = slice(rank * args.per_rank, (rank + 1) * args.per_rank)
    if args.whole_rows:
        rows = {"position_ids": positions, "use_cache": False} if args.packed else {"attention_mask": mask}
        if args.cached:  # (the model's config has use_cache on: both build a cache, and attend across the documents)
            rows.pop("use_cache")
        whole(args, model, reference, ids, rows, labels, world, counts, internals)
    torch.manual_seed(100 + rank)
    given = {"attention_mask": mask[:, mine]}
    if args.packed:
        given = {"position_ids": positions[:, mine], "use_cache": False}
    with internals():  # (see the module docstring)
        loss = model(input_ids=ids[:, mine], shift_labels=shift[:, mine], num_items_in_batch=tokens, **given).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]  # compiled by this process (torch_compile)
    out = {"loss": total.item(), "collectives": counts, "chunks": args.chunk, "compiled_graphs": graphs}
    if args.dropout:  # the masks are the split's own, which no plain forward draws: a central difference instead
        out.update(directional(model, pristine, lambda m: split_loss(m, ids[:, mine], shift[:, mine], tokens, rank)))
    else:
        whole_rows = {"position_ids": positions, "use_cache": False} if args.packed else {"attention_mask": mask}
        with internals():
            logits = reference(input_ids=ids, **whole_rows).logits
            ref = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum") / tokens
            ref.backward()
        worst, where = 0.0, ""
        grads = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            if not p.requires_grad:  # (QLoRA's frozen base weights)
                continue
            q = grads[name].grad
            if q is None:
                worst, where = float("inf"), f"{name} (no gradient)"
                break
            err = ((p.grad - q).norm() / p.grad.norm().clamp_min(1e-300)).item()
            if err > worst:
                worst, where = err, name
        out.update(reference_loss=ref.item(), error=worst, where=where)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


if __name__ == "__main__":
    main()
