"""The options of the stream engine: one frozen object, validated once.

:class:`StreamOptions` is what :func:`~streambp_trl.engine.enable_streambp` takes (as keyword arguments or as the
object itself) and what every ``Stream*Config`` produces (``to_options()``). Its ``__post_init__`` is the one place
where an option is checked, so a bad value gives the same message whether it comes from Python, a YAML config or
the command line. Parsing text into values (``"512"`` from a YAML file or ``--stream_chunk_size 512``) is the
config's business, before it builds the options.
"""

from __future__ import annotations

import dataclasses

from ..layers.compiled import LayerCompile, check_compile
from ..logits import STAT_OUTPUTS
from ..sizing.auto import AUTO
from ..sizing.choices import KV_MODES, PlanChoices
from ..sizing.memory_model import parse_budget


def _config_name(name: str) -> str:
    """How a ``Stream*Config`` spells option ``name``, when that differs (its fields share TRL's namespace)."""
    aliases = {
        "kv_mode": "stream_kv_mode",
        "keep_every": "stream_keep_every",
        "keep_activations": "stream_keep_activations",
        "keep_attention": "stream_keep_attention",
    }
    return aliases.get(name, name)


def _named(name: str) -> str:
    alias = _config_name(name)
    return name if alias == name else f"{name} ({alias} in a config)"


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How :func:`~streambp_trl.engine.enable_streambp` streams a model.

    Args:
        stream_chunk_size: tokens per chunk of each decoder layer's forward and backward, or ``"auto"``: for each
            (batch, length) the largest chunk whose estimated peak fits ``memory_budget`` (see
            :mod:`streambp_trl.sizing.auto`).
        logits_chunk_size: tokens per tile of the logit kernel, or ``"auto"``; ``None`` (default) becomes
            ``stream_chunk_size``.
        kv_mode: ``"recompute"`` or ``"capture"``: how a layer's backward gets its keys/values, recomputed from its
            saved input by a no-grad pass or kept from its forward (2 x kv_dim values per token per attention layer).
            ``None`` (default): each call's plan keeps them where they fit (:mod:`streambp_trl.sizing.plan`),
            recomputes them otherwise, where no memory figure is known or where no plan is made (:attr:`planned`).
        temperature: divides the logits of ``fused_lm_head=True`` calls (TRL's GRPO temperature).
        fused_outputs: fields of ``FusedCausalLMOutput`` computed by ``fused_lm_head=True`` calls, among
            ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; ``log_probs`` is always
            computed and comes first.
        stream_eval: stream the decoder in eval mode too (calls without a key/value cache; for xLSTM also without
            ``use_cache=True``, which asks it to build one), as the no-grad passes of a frozen reference model need to
            reach the training length; otherwise eval mode is the model's own.
        verify: run the probe (two forward passes of 11 tokens) before enabling.
        offload_checkpoints: keep each layer's saved input (and kept keys/values) in pinned host memory between
            forward and backward, brought back one layer ahead (see :mod:`streambp_trl.layers.kept.offload`); a
            no-op on CPU. ``None`` (default): each call's plan decides (:mod:`streambp_trl.sizing.plan`), off where no
            memory figure is known.
        memory_budget: the device memory the step may use, for each call's plan: a size with its unit,
            ``"78GiB"``, ``"80GB"``, ``"512MiB"`` (``"4096B"`` for bytes; a bare number is refused, ``80`` being far
            more likely 80 GiB than 80 bytes), read into bytes in :attr:`choices`; ``None``: the free memory of
            the CUDA device when a call starts. A call with grad whose predicted peak exceeds it is refused before
            its step, whatever the other options fix (with every one fixed, the plan only checks it).
        keep_every: keep only the first input of every ``keep_every`` consecutive decoder layers; each segment's
            other layers rebuild theirs in backward by one more chunked forward (see
            :mod:`streambp_trl.layers.kept.segments`). Not with ZeRO-3 or FSDP. ``None`` (default): each call's plan
            decides which layer inputs are kept (every one where they fit, or no memory figure is known).
        keep_activations: how many of the top decoder layers keep their activations from the forward, so their
            backward recomputes nothing (:mod:`streambp_trl.layers.call.kept`): about a quarter of those layers' step
            saved, for one layer's full-length activations held per layer. Not with ``keep_every`` > 1, ZeRO-3 or
            FSDP (their layers recompute). ``None`` (default): each call's plan keeps as many as the memory it has
            leaves room for (none where no memory figure is known).
        keep_attention: each layer that recomputes keeps its attention outputs (and their log-sum-exps) from the
            forward, so its recompute skips the attention kernels (:mod:`streambp_trl.attention.kept_outputs`): query
            heads x head_dim values per token per layer, for a plainly causal chunk's attention forward (the
            quadratic part of a long sequence's recompute). ``None`` (default): each call's plan keeps them where they
            fit (not where no memory figure is known).
        token_mean_loss: the loss of ``fused_lm_head=True`` calls weights every scored token alike (SFT's negative
            log-likelihood): the logit kernel may form the LM head's gradient in the forward, computing each logit
            once (:mod:`streambp_trl.logits.eager`); checked in backward, which recomputes otherwise. Calls without
            ``fused_lm_head`` do so whatever this says: their loss is the engine's own token mean.
        torch_compile: compile each decoder layer's per-chunk body with ``torch.compile`` (the chunk loop, the
            key/value cache and the attention stay eager; :mod:`streambp_trl.layers.compiled`), by
            ``torch_compile_backend`` (default ``"inductor"``) in ``torch_compile_mode`` (inductor's; CUDA graphs are
            refused), as TrainingArguments name them; setting either of those turns it on, as there.

    What each call's plan takes from these is :attr:`choices` (:class:`~streambp_trl.sizing.choices.PlanChoices`),
    built here once: the chunk (``None`` for ``"auto"``), ``keep_every``, offload, the key/value mode as a
    :class:`~streambp_trl.sizing.choices.KVMode` and the budget in bytes.

    Raises:
        ValueError: naming the option (and its config field, where that is spelled differently), the value given and
            what is accepted.
    """

    stream_chunk_size: int | str
    logits_chunk_size: int | str | None = None
    kv_mode: str | None = None
    temperature: float = 1.0
    fused_outputs: tuple[str, ...] = ("log_probs",)
    stream_eval: bool = False
    verify: bool = True
    offload_checkpoints: bool | None = None
    memory_budget: str | None = None
    keep_every: int | None = None
    keep_activations: int | None = None
    keep_attention: bool | None = None
    token_mean_loss: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    choices: PlanChoices = dataclasses.field(init=False, default=PlanChoices(), repr=False, compare=False)
    compiled: LayerCompile | None = dataclasses.field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("stream_chunk_size", "logits_chunk_size"):
            value = getattr(self, name)
            if not (value == AUTO or _positive_int(value) or (name == "logits_chunk_size" and value is None)):
                raise ValueError(f"{name} must be a positive integer number of tokens or 'auto', got {value!r}.")
        if self.logits_chunk_size is None:
            object.__setattr__(self, "logits_chunk_size", self.stream_chunk_size)
        if self.kv_mode is not None and self.kv_mode not in KV_MODES:
            raise ValueError(
                f"{_named('kv_mode')} must be one of {KV_MODES} or None (planned per call), got {self.kv_mode!r}. "
                "For the plan, leave it unset (on a command line, omit the flag; in YAML, null)."
            )
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a positive number, got {temperature!r}.")
        object.__setattr__(self, "temperature", float(temperature))
        if isinstance(self.fused_outputs, str) or not all(isinstance(f, str) for f in self.fused_outputs):
            raise ValueError(f"fused_outputs must be a tuple of field names, got {self.fused_outputs!r}.")
        unknown = set(self.fused_outputs) - set(STAT_OUTPUTS)
        if unknown:
            raise ValueError(f"Unknown fused_outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
        object.__setattr__(self, "fused_outputs", tuple(dict.fromkeys(("log_probs", *self.fused_outputs))))
        for name in ("stream_eval", "verify", "token_mean_loss", "torch_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.offload_checkpoints is not None and not isinstance(self.offload_checkpoints, bool):
            raise ValueError(
                "offload_checkpoints must be True, False or None (planned per call), "
                f"got {self.offload_checkpoints!r}."
            )
        if self.keep_every is not None and not _positive_int(self.keep_every):
            raise ValueError(
                f"{_named('keep_every')} must be a positive integer number of layers (or None: planned per call), "
                f"got {self.keep_every!r}."
            )
        kept = self.keep_activations
        if kept is not None and not (_positive_int(kept) or kept == 0):
            raise ValueError(
                f"{_named('keep_activations')} must be a number of layers, 0 or more (or None: planned per call), "
                f"got {kept!r}."
            )
        if kept and self.keep_every is not None and self.keep_every > 1:
            raise ValueError(
                f"{_named('keep_activations')}={kept} keeps whole layers' activations while {_named('keep_every')}="
                f"{self.keep_every} rebuilds layer inputs to save memory: set one of them, not both."
            )
        if self.keep_attention is not None and not isinstance(self.keep_attention, bool):
            raise ValueError(
                f"{_named('keep_attention')} must be True, False or None (planned per call), got "
                f"{self.keep_attention!r}."
            )
        for name in ("torch_compile_backend", "torch_compile_mode"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a name (a string) or None, got {getattr(self, name)!r}.")
        check_compile(self.torch_compile_backend, self.torch_compile_mode)
        if self.torch_compile or self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            compiled = LayerCompile(self.torch_compile_backend or "inductor", self.torch_compile_mode)
            object.__setattr__(self, "compiled", compiled)
        choices = PlanChoices(
            chunk=None if self.stream_chunk_size == AUTO else self.stream_chunk_size,
            keep_every=self.keep_every,
            keep_activations=kept,
            keep_attention=self.keep_attention,
            offload=self.offload_checkpoints,
            kv_mode=self.kv_mode,
            budget=None if self.memory_budget is None else parse_budget(self.memory_budget),
        )
        object.__setattr__(self, "choices", choices)

    @property
    def auto(self) -> bool:
        """Whether a chunk size is chosen per call (``"auto"``)."""
        return AUTO in (self.stream_chunk_size, self.logits_chunk_size)

    @property
    def planned(self) -> bool:
        """Whether each call is planned (:mod:`streambp_trl.sizing.auto`): where anything is chosen per call (a chunk
        size, the kept layer inputs or checkpoint offload, and then whether keys/values are kept from the forward,
        unless ``kv_mode`` is set), or where a ``memory_budget`` is given, which every call is checked against
        whatever the options fix."""
        # (kv_mode None is planned where a plan is made, and recompute where no plan is made)
        chosen = self.auto or self.keep_every is None or self.offload_checkpoints is None
        return chosen or self.memory_budget is not None
