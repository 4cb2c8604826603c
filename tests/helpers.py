"""Code the test modules share (tiny models built from configs, and their batches, are in ``tests/models.py``).

* the tiny checkpoint ``configs/tiny_model``, its tokenizer and the tiny datasets of ``configs/data``, and
  :func:`args`, the trainer config of one plain SGD step;
* trainer parity: :func:`train` runs a trainer and records its update, :func:`assert_same_training` runs TRL's
  trainer and ours on the same inputs and compares what they do, :func:`assert_each_close` is its per-tensor bound;
* plain autograd: :func:`reference_loss`, :func:`max_rel_grad_error`, :func:`assert_matches_plain` (the float64
  exactness check), :func:`saved_hidden_sized`, :func:`loss_and_grads`;
* recorders: :class:`RecordUpdate` (an optimizer step's update), :class:`ShapeRecorder` and
  :class:`ShapesEveryStep` (every tensor shape an op produces), :class:`CopyingOffload` (the checkpoint offload's
  host copies);
* :func:`torchrun`, which runs a worker script of this folder in several processes.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import Dataset, load_dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer, TrainerCallback

from streambp_trl.engine import is_streaming
from streambp_trl.layers.kept.offload import CheckpointOffload
from streambp_trl.trainers.stream_config import StreamArguments

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = ROOT / "configs" / "tiny_model"
DATA = ROOT / "configs" / "data"
CHUNK = 8  # the stream trainers' chunk in args(): far below the sequence lengths, so every layer really streams
EXACT = 1e-10  # relative bound of a float64 streamed loss and gradients against plain autograd
# every layer recomputed in backward, its attention too (the plan keeps activations or attention outputs where they
# fit): for tests of the recompute itself
RECOMPUTED = {"keep_activations": 0, "keep_attention": False}
CUDASIM = ROOT.parent / "shared" / "cudasim"  # the CUDA peak-memory simulator, beside the checkout


def cudasim_missing() -> str | None:
    """Why the CUDA simulator cannot run here, or ``None``: it must be beside the checkout, compiles a small fake
    CUDA library with g++, and fakes CUDA on a CPU build of torch (a CUDA build without a GPU looks for the driver)."""
    if not (CUDASIM / "fakecuda.py").is_file():
        return f"the CUDA simulator is not at {CUDASIM}"
    if shutil.which("g++") is None:
        return "g++ is missing: the CUDA simulator compiles a small fake-CUDA library"
    if torch.version.cuda is not None and not torch.cuda.is_available():
        return f"torch {torch.__version__} is a CUDA build without a GPU: the CUDA simulator fakes CUDA on a CPU build"
    return None


# -- the tiny checkpoint, its data and its trainer config ---------------------------------------------------------


def load_model() -> PreTrainedModel:
    """The tiny Qwen3 checkpoint ``configs/tiny_model``, in float32."""
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def load_tokenizer():
    """The tokenizer of ``configs/tiny_model``."""
    return AutoTokenizer.from_pretrained(MODEL)


def tiny_dataset(name: str, rows: int | None = None) -> Dataset:
    """``configs/data/tiny_<name>.jsonl``, its first ``rows`` rows (all by default)."""
    split = "train" if rows is None else f"train[:{rows}]"
    return load_dataset("json", data_files=str(DATA / f"tiny_{name}.jsonl"), split=split)


def args(config_cls, output_dir, **overrides):
    """One SGD step, learning rate 1, no clipping or decay, float32 on the CPU: the update is -grad.

    A stream config also gets ``stream_chunk_size=CHUNK`` and ``logits_chunk_size=5``; ``overrides`` come last."""
    base = dict(
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    if issubclass(config_cls, StreamArguments):
        base.update(stream_chunk_size=CHUNK, logits_chunk_size=5)
    return config_cls(**{**base, **overrides})


# -- recorders ----------------------------------------------------------------------------------------------------


class RecordUpdate(TrainerCallback):
    """The update SGD applies, -lr * grad, taken before it is added to the float32 weights (the last step's).

    Stored float32 weights round p + dp to the spacing of p (about 1e-7 for a norm weight of 1), which is 1e-4 of
    a typical one-step update here, above the 1e-5 bar; the update itself is what the two trainers compute.
    """

    def __init__(self):
        self.update: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.update = {
            n.replace("base_model.model.", ""): -args.learning_rate * p.grad.detach().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op produces, as ``(op name, shape)``."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def full_size(self, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
        """The recorded ``(op, shape)`` pairs with two dimensions of at least ``seq_len``: (T x T)-sized tensors."""
        return [(op, s) for op, s in self.shapes if sum(d >= seq_len for d in s) >= 2]


class ShapesEveryStep(TrainerCallback):
    """Records every tensor shape produced during the training steps (only step ``step``, 0-based, when given), and
    whether the model still streams after each step."""

    def __init__(self, step: int | None = None):
        self.step, self.recorder, self.streaming = step, ShapeRecorder(), []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step in (None, state.global_step):
            self.recorder.__enter__()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.step in (None, state.global_step - 1):
            self.recorder.__exit__(None, None, None)
        self.streaming.append(is_streaming(model))


class CopyingOffload(CheckpointOffload):
    """Offload that also moves CPU tensors (to plain host memory, there being no pinned allocator here), recording
    what it saved, loaded and prefetched, so the whole copy path runs on this machine."""

    def __init__(self):
        super().__init__(pin_memory=False)
        self.events: list[tuple[str, int]] = []
        self.ids: dict[int, int] = {}

    def offloads(self, t: torch.Tensor) -> bool:
        return True

    def save(self, tensors):
        kept = super().save(tensors)
        if not tensors:  # the first layer's input is rebuilt from the token ids: nothing kept
            return kept
        self.ids[id(kept)] = len(self.ids)
        self.events.append(("save", self.ids[id(kept)]))
        original = kept.prefetch

        def prefetch(side, _kept=kept):
            if _kept.back is None and _kept.host is not None:
                self.events.append(("prefetch", self.ids[id(_kept)]))
            return original(side)

        kept.prefetch = prefetch
        return kept

    def load(self, kept):
        self.events.append(("load", self.ids[id(kept)]))
        return super().load(kept)


# -- trainer parity -----------------------------------------------------------------------------------------------


def train(
    trainer_cls,
    config_cls,
    output_dir,
    dataset: Dataset,
    *,
    ref_model: bool = False,
    peft_config=None,
    rewards: Callable[[], list] | None = None,
    model: Callable[[], PreTrainedModel] = load_model,
    callbacks: tuple[TrainerCallback, ...] = (),
    **overrides,
) -> tuple[Trainer, dict[str, torch.Tensor]]:
    """Train ``trainer_cls`` from :func:`load_model` on ``dataset`` with :func:`args` (``overrides`` on top) in
    ``output_dir/<trainer class name>``; return the trainer and its last optimizer step's update
    (:class:`RecordUpdate`).

    ``ref_model``: give the trainer a separately loaded reference model (otherwise it makes its own, if it uses one);
    ``peft_config``: a copy of it; ``rewards``: builds the reward functions (GRPO, RLOO), anew for each trainer;
    ``model``: builds the policy (and the reference), the same weights on every call; ``callbacks``: the trainer's
    besides the recorder.
    """
    record = RecordUpdate()
    extra = {}
    if ref_model:
        extra["ref_model"] = model()
    if rewards is not None:
        extra["reward_funcs"] = rewards()
    trainer = trainer_cls(
        model=model(),
        args=args(config_cls, Path(output_dir) / trainer_cls.__name__, **overrides),
        train_dataset=dataset,
        processing_class=load_tokenizer(),
        peft_config=copy.deepcopy(peft_config),
        callbacks=[*callbacks, record],
        **extra,
    )
    trainer.train()
    return trainer, record.update


class LengthReward:
    """A reward (completion length in characters) that records every completion it scores."""

    def __init__(self):
        self.seen: list[str] = []
        self.__name__ = "length_reward"

    def __call__(self, completions, **kwargs):
        self.seen += list(completions)
        return [float(len(c)) for c in completions]


def assert_each_close(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], bound: float, what: str = "update"
) -> None:
    """``actual`` has the names of ``expected`` (at least one), each tensor within relative error ``bound`` of the
    expected one (the norm of the difference over the expected norm)."""
    assert set(actual) == set(expected) and expected
    for name, ref in expected.items():
        err = ((actual[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < bound, f"{name}: relative error of the {what} {err:.2e}"


def assert_same_training(
    trl: tuple, stream: tuple, output_dir, dataset: Dataset, **options
) -> tuple[Trainer, Trainer]:
    """TRL's trainer and ours, each a ``(trainer class, config class)`` pair, :func:`train` on ``dataset`` with the
    same seed and ``options`` (``stream_*`` config fields go to ours only), and do the same:

    * ours streams: the chunk size asked for (:data:`CHUNK` unless set), the policy and any reference model;
    * each parameter's update is TRL's within relative error 1e-5;
    * every metric TRL logs (but the step counters, learning rate, gradient norm and wall-clock timings) equals
      ours within 1e-5 (relative, absolute below 1; a policy loss relative to the rewards' spread too).

    Returns TRL's trainer and ours.
    """
    trl_options = {k: v for k, v in options.items() if not k.startswith("stream_")}
    ref_trainer, ref_update = train(*trl, output_dir, dataset, **trl_options)
    ours, update = train(*stream, output_dir, dataset, **options)
    assert ours.stream_options.stream_chunk_size == options.get("stream_chunk_size", CHUNK)
    assert is_streaming(ours.model)
    if getattr(ours, "ref_model", None) is not None:
        assert is_streaming(ours.accelerator.unwrap_model(ours.ref_model))
    assert_each_close(ref_update, update, 1e-5)
    ref_logs = [h for h in ref_trainer.state.log_history if "loss" in h]
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == len(ref_logs)
    for r, h in zip(ref_logs, logs, strict=True):
        for key, value in r.items():
            if key in ("epoch", "step", "learning_rate", "grad_norm") or not isinstance(value, float):
                continue
            if key.endswith("_time") or key.startswith("profiling/"):  # wall-clock timings
                continue
            # a policy loss is a mean of ratio x advantage terms: it can cancel to 0 exactly in TRL's trainer (both
            # log-prob passes bit-equal) while its rounding in ours scales with the advantages (the rewards' spread)
            scale = max(1.0, abs(value), r.get("reward_std", 0.0) if key == "loss" else 0.0)
            assert abs(h[key] - value) <= 1e-5 * scale, (key, h[key], value)
    return ref_trainer, ours


# -- plain autograd -----------------------------------------------------------------------------------------------


def count_calls(monkeypatch, owner: type, name: str, note: Callable) -> list:
    """Wraps ``owner.name`` for the test (``monkeypatch``): each call still runs and appends ``note(self, *args)``
    to the list returned."""
    calls: list = []
    original = getattr(owner, name)

    def counted(self, *args, **kwargs):
        calls.append(note(self, *args, **kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def reference_loss(model, ids, mask, labels):
    """Plain autograd, loss in the model's own dtype (HF's loss_function upcasts only to float32)."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None and model.config.model_type != "gemma3_text":
        raise AssertionError("softcapping expected only for gemma3 here")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def max_rel_grad_error(reference, candidate) -> tuple[float, str]:
    """The largest relative gradient error of ``candidate``'s parameters against ``reference``'s, and where."""
    worst, where = 0.0, ""
    cand = dict(candidate.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        q = cand[name].grad
        assert q is not None, f"{name} got no gradient"
        err = ((p.grad - q).norm() / p.grad.norm().clamp_min(1e-300)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def assert_matches_plain(reference, streamed, ids, mask, labels, tol: float = EXACT, **call) -> float:
    """One backward of ``reference`` (plain autograd, :func:`reference_loss`) and of the streaming ``streamed``
    (called with ``call`` besides the batch): the losses and every gradient agree within relative error ``tol``.
    Returns the largest gradient error."""
    ref_loss = reference_loss(reference, ids, mask, labels)
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels, **call).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, streamed)
    assert err < tol, f"relative gradient error {err:.3e} at {where}"
    return err


def saved_hidden_sized(model, ids, mask, labels) -> tuple[torch.Tensor, int]:
    """The loss, and how many (batch, T, hidden) tensors autograd keeps for the backward."""
    count = [0]
    shape = (*ids.shape, model.config.hidden_size)

    def pack(t):
        count[0] += tuple(t.shape) == shape
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return loss, count[0]


def loss_and_grads(model, ids, mask, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one forward/backward from cleared gradients, and a copy of every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- processes ----------------------------------------------------------------------------------------------------


def torchrun(script: str, *args: str, log: Path, nproc: int = 2, timeout: int = 300) -> None:
    """``torchrun --standalone`` of ``tests/<script>`` in its own session, its output to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    with open(log, "w") as f:
        code = subprocess.run(
            [*cmd, str(HERE / script), *args],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env=env,
            start_new_session=True,
        ).returncode
    assert code == 0, log.read_text()[-4000:]
