"""What every ``Stream*Trainer`` adds to its TRL trainer: one place to install the engine and log it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn

from ..engine import (
    StreamOptions,
    check_fits,
    chunk_sizes,
    count_optimizer,
    enable_streambp,
    mark_zero3_leaves,
    plan_fields,
    zero3_enabled,
)
from ..engine.lm_forward import logit_transform
from ..engine.support import router_loss_refusal
from ..engine.whole_rows import group_batch
from ..logs import get_logger
from ..sizing.auto import NoPlanFits
from .sequence_rows import (
    WholeRowsLoader,
    check_online_split,
    context_parallel_group,
    context_parallel_inputs,
    deepspeed_sequence_group,
    first_ranks,
    first_ranks_random_state,
    keep_attention_masks,
    own_attention,
    restore_attention,
)
from .stream_config import stream_options

logger = get_logger(__name__)


def taken_over(args):
    """``args``, or a copy of it with what the stream engine takes over turned off: Hugging Face activation
    checkpointing (the engine checkpoints and streams every decoder layer itself), TRL's activation offloading
    (``activation_offloading=True`` is the engine's ``offload_checkpoints=True``,
    :func:`~.stream_config.stream_options`, read from ``args`` as given: never a second offload on top of it) and
    ``torch_compile`` with its backend and mode (the engine compiles each decoder layer's per-chunk body,
    :mod:`streambp_trl.layers.compiled`; accelerate would compile the whole model, streamed layers included). The
    caller's config object is never changed."""
    checkpointing = getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    offloading = getattr(args, "activation_offloading", False)
    compiling = getattr(args, "torch_compile", False)
    if not (checkpointing or offloading or compiling):
        return args
    args = copy.copy(args)
    if checkpointing:
        logger.info("activation_checkpointing=True is provided by the stream engine; Hugging Face's is turned off.")
        args.activation_checkpointing = args.gradient_checkpointing = False
    if offloading:
        logger.info("activation_offloading=True is the stream engine's offload_checkpoints=True; TRL's is turned off.")
        args.activation_offloading = False
    if compiling:
        logger.info("torch_compile=True compiles each streamed layer's per-chunk body, not the whole model.")
        args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    return args


def default_args(config_cls, model):
    """The config a trainer builds when given none, as TRL's trainers do: output directory ``<model>-<method>``
    (``StreamSFTConfig``: ``Qwen3-8B-SFT``)."""
    name = model if isinstance(model, str) else model.config._name_or_path
    method = config_cls.__name__.removeprefix("Stream").removesuffix("Config")
    return config_cls(f"{name.split('/')[-1]}-{method}")


def _sequence_split(trainer) -> tuple[int, Callable[[], dist.ProcessGroup] | None]:
    """How many ranks ``trainer`` splits each sequence across (1: none) and how to get their process group, as TRL's
    users set the split in ``parallelism_config`` (in the config or the accelerate config), which the engine serves
    with its own key/value exchange (:mod:`streambp_trl.layers.sequence_split`), where the trainer says how its rows
    reach the ranks (``sequence_rows``, :mod:`.sequence_rows`):

    * DeepSpeed's sequence parallelism (``sp_backend="deepspeed"``, ``sp_size`` > 1): DeepSpeed's sequence-parallel
      group;
    * context parallelism under FSDP2 (``cp_size`` > 1): the device mesh's ``"cp"`` group, whose ranks accelerate
      hands the same batches (the trainer cuts the shares, :func:`~.sequence_rows.context_parallel_inputs`, in place
      of torch's ring attention).

    Refused at construction: a split in a trainer that does not say how its rows reach the ranks (accelerate itself
    refuses another backend)."""
    configs = (getattr(trainer.args, "parallelism_config", None), getattr(trainer, "accelerator", None))
    split, group = 1, None
    for config in (configs[0], getattr(configs[1], "parallelism_config", None)):
        cp, sp = getattr(config, "cp_size", None) or 1, getattr(config, "sp_size", None) or 1
        if (cp > 1 or sp > 1) and not trainer.sequence_rows:
            raise ValueError(
                f"{type(trainer).__name__}: context/sequence parallelism (parallelism_config cp_size={cp}, "
                f"sp_size={sp}) is served by StreamBP where the trainer says how its rows reach the ranks, which "
                f"{type(trainer).__name__} does not. Set cp_size=1 and sp_size=1 in the accelerate config or "
                "`parallelism_config`, or shard the model instead (DDP, FSDP2 or DeepSpeed ZeRO); lower "
                "`stream_chunk_size` to fit longer sequences."
            )
        if sp > 1:
            split, group = sp, deepspeed_sequence_group
        elif cp > 1:
            split, group = cp, context_parallel_group(trainer.accelerator)
    return split, group


def _refuse_whole_model_compile(trainer) -> None:
    """Refuse accelerate's own whole-model compile, set outside the training config (``dynamo_backend`` in the
    accelerate config file, ``ACCELERATE_DYNAMO_BACKEND``): it would trace the streamed layers' autograd Functions and
    fail at the first step. The config's ``torch_compile`` is the engine's (:func:`taken_over`)."""
    plugin = getattr(getattr(trainer.accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    if backend is not None and str(getattr(backend, "value", backend)).upper() != "NO":
        raise ValueError(
            f"{type(trainer).__name__}: accelerate compiles the whole model (dynamo_backend={backend.value!r}, from "
            "the accelerate config or ACCELERATE_DYNAMO_BACKEND), which the streamed layers cannot run. Set "
            "dynamo_backend to 'no' there and torch_compile=True in the training config: the stream engine then "
            "compiles each layer's per-chunk body."
        )


def _say_where_trl_differs(trainer) -> None:
    """Warn where this trainer's step differs from TRL's on purpose: TRL's fused LM head (its trainers' default) reads
    a model's logit softcap from ``final_logit_softcapping`` only, so TRL trains a model that caps its logits under
    another name (xLSTM's ``output_logit_soft_cap``) on uncapped ones; the stream engine caps them as the model's own
    forward does (:func:`~streambp_trl.engine.lm_forward.logit_transform`)."""
    for role in ("model", "ref_model", "teacher_model"):
        model = getattr(trainer, role, None)
        if model is not None:  # (a reference or teacher may be wrapped: a DeepSpeed engine's config is a dict)
            model = trainer.accelerator.unwrap_model(model)
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else None
        cap = logit_transform(config)[0] if config is not None else None
        if cap is not None and getattr(config, "final_logit_softcapping", None) is None:
            logger.warning(
                f"{type(trainer).__name__} scores {type(model).__name__} ({role}) by its logits capped at {cap} "
                "(output_logit_soft_cap), as the model's own forward computes them. TRL's fused LM head does not read "
                "that setting, so TRL's own trainer differs here: it uses uncapped logits."
            )


def _zero3_run(args) -> bool:
    """Whether ``args`` (the trainer's config) trains under DeepSpeed ZeRO-3: a ``deepspeed`` config, or accelerate's
    DeepSpeed plugin (``accelerate launch`` with a ZeRO-3 config, with or without ``zero3_init_flag``)."""
    plugin = getattr(args, "deepspeed_plugin", None)
    return getattr(plugin, "zero_stage", None) == 3


def _mark_zero3_leaves(models) -> None:
    """Each transformers model among ``models`` gets its decoder layers marked as ZeRO-3 leaf modules (see
    :func:`streambp_trl.engine.mark_zero3_leaves`); anything else (a model name, a dataset) is skipped."""
    for model in models:
        if isinstance(model, nn.Module):
            try:
                mark_zero3_leaves(model)
            except TypeError:  # not a transformers model: enable_streambp will say so
                pass


class StreamTrainerMixin:
    """Installs StreamBP on the policy ``self.model`` and on a separate ``self.ref_model`` (eval-mode passes stream
    too, so reference and evaluation passes reach the training length) once TRL's constructor has built them, and
    logs the stream settings and, on CUDA, the peak memory of each step.

    A trainer hands TRL's constructor ``self._stream_args(args, model)`` for its config and sets ``config_class`` (its
    ``Stream*Config``) and ``_fused_outputs()`` (the ``FusedCausalLMOutput`` fields TRL's trainer reads from the
    policy). Installing is idempotent: a trainer that computes reference log-probs inside TRL's ``__init__``
    (``precompute_ref_log_probs``) installs the engine first.
    """

    config_class: type  # the trainer's Stream*Config, built when no config is given
    rows_per_example = 1  # rows an example takes in a training call (2: its chosen and rejected completions)
    stream_options: StreamOptions | None = None  # the policy's, once installed
    logits_tiled = True  # the model's loss reads the logit kernel, whose tile (logits_chunk_size) is logged
    # how the trainer's rows reach the ranks of a sequence split (DeepSpeed's sp_size > 1): "shares" or "whole"
    # (.sequence_rows); None: the trainer refuses one
    sequence_rows: str | None = None
    # once installed: the process group a sequence split's ranks form (``enable_streambp``'s ``sequence_group``), or
    # None where this run splits no sequence
    sequence_group: Callable[[], dist.ProcessGroup] | None = None
    _given_options: StreamOptions | None = None  # read from the config as given (see _stream_args)

    def __init__(self, *args, **kwargs):
        # Under ZeRO-3 the decoder layers must be leaf modules before DeepSpeed registers its hooks, which TRL does
        # inside its constructor for a reference model (DPO): mark the models given here first.
        config = kwargs.get("args", next((a for a in args if hasattr(a, "deepspeed_plugin")), None))
        if _zero3_run(config):
            _mark_zero3_leaves([*args, *kwargs.values()])
        super().__init__(*args, **kwargs)
        self._install_stream_engine()

    def _stream_args(self, args, model):
        """The config TRL's constructor gets: ``args`` (TRL's default of ``config_class`` when ``None``) with Hugging
        Face's checkpointing, TRL's activation offloading and ``torch_compile`` taken over by the engine
        (:func:`taken_over`); the stream options are read from ``args`` as given."""
        args = args if args is not None else default_args(self.config_class, model)
        self._given_options = stream_options(args)
        return taken_over(args)

    def _build_accelerator_args(self, **kwargs) -> dict:
        """transformers' accelerator arguments, with DDP's ``find_unused_parameters`` off unless the config (or TRL,
        for a vision-language model) sets it.

        transformers turns the search on for a model without Hugging Face checkpointing, which the stream trainers
        turn off; the engine is that checkpointing, and with it every trainable parameter reaches autograd in every
        backward: each decoder layer's parameters are inputs of its streamed Function, which returns a gradient for
        each (``None`` for one no chunk reached, e.g. an unrouted expert, which DDP's reducer takes as zeros), and the
        embedding, final norm and LM head take part in every step. The search would find nothing, at the price of a
        graph traversal and an extra all-reduce per step and PyTorch's warning saying so. (A parameter no rank reached
        then steps with a zero gradient rather than none; ``ddp_find_unused_parameters=True`` keeps it at none.)
        """
        args = super()._build_accelerator_args(**kwargs)
        if self.args.ddp_find_unused_parameters is None:
            for handler in args.get("kwargs_handlers", ()):
                if isinstance(handler, DistributedDataParallelKwargs):
                    handler.find_unused_parameters = False
        return args

    def _fused_outputs(self) -> tuple[str, ...]:
        return ("log_probs",)

    def _engine_options(self) -> dict:
        """Further ``enable_streambp`` options for the policy and the reference (e.g. the sampling temperature)."""
        return {}

    def _install_stream_engine(self) -> None:
        if self.stream_options is not None:
            return
        split, group = _sequence_split(self)
        _refuse_whole_model_compile(self)
        if getattr(self, "aux_loss_enabled", False):
            raise router_loss_refusal(
                type(self).__name__,
                f"router_aux_loss_coef={self.router_aux_loss_coef}",
                "Set `router_aux_loss_coef=0.0` in the config to train without it.",
            )
        given = self._given_options if self._given_options is not None else stream_options(self.args)
        options = dataclasses.replace(given, **self._engine_options(), stream_eval=True)
        if (options.keep_every or 1) > 1 and (_zero3_run(self.args) or getattr(self, "is_fsdp_enabled", False)):
            raise ValueError(
                f"{type(self).__name__}: stream_keep_every={options.keep_every} rebuilds layer inputs by running "
                "decoder layers inside other layers' backward, where FSDP shards and ZeRO-3 partitions are not "
                "gathered. Use stream_keep_every=1 (offload_checkpoints=True saves GPU memory there), or DDP / ZeRO-2."
            )
        if _zero3_run(self.args) and not zero3_enabled(self.model):  # enable_streambp marks them when it can tell
            _mark_zero3_leaves([self.model])
        policy = dataclasses.replace(options, fused_outputs=self._fused_outputs())
        _say_where_trl_differs(self)
        whole = split > 1 and self.sequence_rows == "whole"
        enable_streambp(self.model, policy, sequence_group=group, whole_rows=whole)
        self.sequence_group = group
        if whole:  # every rank of the group trains the same batch: TRL's replicated-batch token count
            self._tp_size = getattr(self, "_tp_size", 1) * split
        if self._context_parallel:
            keep_attention_masks(self.accelerator)
        elif whole:  # (under context parallelism accelerate already hands the group's ranks the same batches)
            self._own_attention = own_attention()
            self.accelerator.deepspeed_ulysses_dl_adapter = self._whole_rows_loader
        self._count_optimizer_state()
        self._check_longest_batch()
        ref_model = getattr(self, "ref_model", None)
        if ref_model is not None:  # (split too in a training step's reference pass: training_step)
            enable_streambp(self.accelerator.unwrap_model(ref_model), options, sequence_group=group, whole_rows=whole)
        self.stream_options = policy

    def _whole_rows_loader(self, loader, model) -> WholeRowsLoader:
        """What transformers' Trainer asks accelerate for once the model is prepared under DeepSpeed's sequence
        parallelism (``deepspeed_ulysses_dl_adapter``): for a trainer whose rows reach the ranks whole, the loader
        that hands every rank of the group the same batch (:class:`~.sequence_rows.WholeRowsLoader`). The attention
        functions DeepSpeed's preparation replaced in transformers' registry (its Ulysses exchange, which expects a
        share of each row) are given back, since every call the engine does not stream has the whole rows here."""
        restore_attention(self._own_attention)
        return WholeRowsLoader(loader, deepspeed_sequence_group())

    @property
    def splits_sequences(self) -> bool:
        """Whether this run splits each sequence across ranks (once installed)."""
        return self.sequence_group is not None

    @property
    def _context_parallel(self) -> bool:
        """Whether the split is FSDP2's context parallelism (``cp_size``), not DeepSpeed's (``sp_size``)."""
        return self.splits_sequences and self.sequence_group is not deepspeed_sequence_group

    def _prepare_context_parallel_inputs(self, model, inputs):
        """transformers' training step under context parallelism (``cp_size`` > 1), in place of torch's ring
        attention (``context_parallel``, which the engine's own key/value exchange replaces): this rank's share of
        every row where the trainer's rows reach the ranks as shares (:func:`~.sequence_rows.context_parallel_inputs`),
        the rows as given where whole. transformers' prediction step (without grad) gets the rows whole: the engine
        streams eval-mode calls unsplit."""
        if not self._context_parallel:
            return super()._prepare_context_parallel_inputs(model, inputs)
        if self.sequence_rows == "whole" or not torch.is_grad_enabled():
            return contextlib.nullcontext, inputs
        return contextlib.nullcontext, context_parallel_inputs(inputs, self.sequence_group())

    def _count_optimizer_state(self) -> None:
        """The policy's per-call plan counts the state of the optimizer ``args.optim`` names from the first step,
        before the optimizer has allocated it (:meth:`~streambp_trl.sizing.auto.AutoChunks.count_optimizer`). Not
        under DeepSpeed or FSDP, whose optimizer state is partitioned or offloaded (there the plan counts it once
        allocated, as the device's allocation), nor for an optimizer the memory model does not size (said at info
        level), nor for one the user built or named by class (``optimizers=``, ``optimizer_cls_and_kwargs``), which
        ``args.optim`` does not describe: counted once allocated."""
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return
        if getattr(self, "optimizer", None) is not None or getattr(self, "optimizer_cls_and_kwargs", None):
            return
        try:
            count_optimizer(self.model, self.args.optim, self)
        except ValueError as error:
            logger.info(f"StreamBP's plan counts the optimizer state once allocated, not before: {error}")

    def _longest_batch(self) -> tuple[tuple[int, int], str] | None:
        """``((rows, tokens), why)``: the longest training call this config lets TRL's collator build, and the
        settings that bound it; ``None`` where the config bounds no length (``max_length=None``). Each of
        ``per_device_train_batch_size`` examples takes :attr:`rows_per_example` rows of at most ``max_length`` tokens
        (rounded up to ``pad_to_multiple_of``)."""
        length = getattr(self.args, "max_length", None)
        if not length:
            return None
        multiple = getattr(self.args, "pad_to_multiple_of", None)
        if isinstance(multiple, int) and multiple > 1:
            length = -(-length // multiple) * multiple
        batch = self.args.per_device_train_batch_size
        why = f"per_device_train_batch_size={batch}, max_length={self.args.max_length}"
        if self.rows_per_example > 1:
            why += f", {self.rows_per_example} rows per example (chosen and rejected)"
        return (batch * self.rows_per_example, length), why

    def _check_longest_batch(self) -> None:
        """Refuse at construction a config whose longest batch (:meth:`_longest_batch`) fits no way of running within
        the memory_budget (or the CUDA device's free memory), rather than at the first step that reaches it. Not under
        DeepSpeed or FSDP, whose partitioned state the plan counts only once allocated. A batch of several rows is
        sized padded, as TRL's collators pad them to the longest, and a padding-free one packed: their attention
        builds mask blocks over the whole prefix."""
        longest = self._longest_batch()
        if longest is None or getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return
        (rows, tokens), why = longest
        try:
            check_fits(self.model, rows, tokens, padded=rows > 1 or bool(getattr(self, "padding_free", False)))
        except NoPlanFits as error:
            raise NoPlanFits(f"{type(self).__name__}, the longest batch of this config ({why}): {error}") from None

    def training_step(self, *args, **kwargs):
        """TRL's training step, its peak memory logged on CUDA, inside
        :func:`~streambp_trl.engine.whole_rows.group_batch`: with whole rows split across ranks its batch is the
        group's (:class:`WholeRowsLoader`), so the no-grad passes of an eval-mode reference model (DPO's, KTO's,
        GRPO's, RLOO's) stream this rank's share of it as the policy does (a model enabled without ``whole_rows``
        reads nothing of it)."""
        cuda = torch.cuda.is_available() and self.args.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.args.device)
        with group_batch():
            loss = super().training_step(*args, **kwargs)
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.args.device) / 2**30
            self._metrics["train"]["peak_memory_gib"].append(peak)
        return loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.model.training and "loss" in logs:
            fields = plan_fields(self.model)  # those of the last streamed call ("auto" chooses per shape)
            logs.update(fields)
            if fields and self.logits_tiled:
                logs["logits_chunk_size"] = chunk_sizes(self.model)[1]
        super().log(logs, *args, **kwargs)


class StreamGeneratingMixin(StreamTrainerMixin):
    """A trainer that generates its completions (GRPO, RLOO, on-policy distillation), with the sequence split across
    ranks: every rank of the group trains the same prompts (whole rows) and generates for them from the group's first
    rank's random state (TRL seeds the ranks apart), so the completions, TRL's shuffle of them and the losses are the
    same on every rank; the first rank's completions are taken as well (:func:`~.sequence_rows.first_ranks`), and
    TRL's token count, which sums every rank's, counts them once."""

    sequence_rows = "whole"

    def _generate(self, prompts: list):
        if not (self.splits_sequences and self.model.training):  # (evaluation: each rank its own prompts)
            return super()._generate(prompts)
        group = self.sequence_group()
        first_ranks_random_state(group)
        seen = self.state.num_input_tokens_seen
        generated = first_ranks(super()._generate(prompts), group)
        counted = self.state.num_input_tokens_seen - seen  # (every rank's copy)
        self.state.num_input_tokens_seen = seen + counted // dist.get_world_size(group)
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        return generated


class StreamOnlineRLMixin(StreamGeneratingMixin):
    """What GRPO and RLOO read from their fused head, at the sampling temperature, and the settings a sequence split
    refuses (:func:`~.sequence_rows.check_online_split`)."""

    def _install_stream_engine(self) -> None:
        super()._install_stream_engine()
        if self.splits_sequences:
            check_online_split(self)

    def _fused_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy")

    def _engine_options(self) -> dict:
        return {"temperature": self.temperature}
