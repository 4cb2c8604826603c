"""What :func:`~streambp_trl.engine.enable_streambp` finds and chooses once, kept on the model as ``model._streambp``.

Found once at install: the decoder, its stream layers and the configs their attention reads, where the final norm the
logit kernel may apply sits, the layers' facts and the per-call plan policy. The forwards the engine installs
are bound to this one object; a streamed call builds its own :class:`~streambp_trl.layers.DecoderCall` from it.

What user code may change on the model after enabling is read from the live model at each streamed call, never from
what was found at install: the final norm is the module the decoder holds now (:meth:`EngineState.final_norm`: a norm
replaced, or wrapped by PEFT's ``modules_to_save``, is the one applied), and the hooks that decide where it runs are
those on the modules now (:func:`~.head_side.decode_for_head`); a decoder or decoder layer replaced, removed or added
since install, which the installed hooks do not reach, is refused by name (:meth:`EngineState.check_decoder`,
:meth:`EngineState.check_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ..layers import DecoderCall, LayerFacts
from ..layers.kept import CheckpointOffload
from ..layers.sharding import sharded_module
from ..logits.forms import HeadForm
from ..logs import get_logger
from ..sizing.auto import AUTO, AutoChunks
from ..sizing.choices import NO_MASKS, MaskBlocks, StepPlan
from ..sizing.room import head_form
from .mask_blocks import model_window
from .model_parts import final_norm, named_decoder_layers
from .options import StreamOptions
from .support import refuse

logger = get_logger(__name__)

_AGAIN = "call enable_streambp(model) again after changing the model, so that it streams the model as it is"


@dataclasses.dataclass
class EngineState:
    """The engine installed on one causal LM.

    ``options``: as validated; ``decoder``: the model that runs the layers; ``layers``: its stream layers, each with
    its hook installed, bound to its facts in ``facts`` (what the hook needs that no call changes); ``configs``: the
    transformers configs their mask and attention code read (switched to ``"streambp"`` for a streamed call);
    ``decoder_path``: the decoder's name in the causal LM; ``norm_name``: the decoder's attribute holding its final
    norm when the probe showed that norm is the decoder's last step, so the head may apply it to the rows it reads
    (:meth:`final_norm`), else ``None``; ``auto``: the per-call plan policy where anything is planned (each call's
    plan comes from :meth:`call_for`, the one road to the layers); ``decoder_keywords``: the only keyword
    arguments the model's own forward hands its decoder, where it names them (``None``: it passes on its
    ``**kwargs``). Two states are equal when their choices are (the modules they point to are not compared: a copy
    of the model has its own).
    """

    options: StreamOptions
    decoder: PreTrainedModel = dataclasses.field(compare=False)
    layers: list[nn.Module] = dataclasses.field(compare=False)
    facts: tuple[LayerFacts, ...] = dataclasses.field(compare=False)
    configs: tuple = dataclasses.field(compare=False)
    decoder_path: str = dataclasses.field(compare=False)
    norm_name: str | None = dataclasses.field(compare=False)
    auto: AutoChunks | None
    decoder_keywords: frozenset[str] | None = None
    head_form: HeadForm | None = dataclasses.field(default=None, compare=False)  # the latest call's logit form
    # where a call's plan offloads the kept layer inputs: the model's one offloader
    offloader: CheckpointOffload = dataclasses.field(default_factory=CheckpointOffload, compare=False)
    unstreamed_said: bool = dataclasses.field(default=False, compare=False)  # see say_if_unstreamed
    fixed_said: set = dataclasses.field(default_factory=set, compare=False)  # the call shapes _say_fixed said
    # the process group each training call's sequences are split across (:mod:`~streambp_trl.layers.sequence_split`),
    # asked for at each call (a launcher may build it after enabling)
    sequence_group: Callable[[], object] | None = dataclasses.field(default=None, compare=False)
    whole_rows: bool = False  # every rank of the group is given the whole rows, and cuts its share (.whole_rows)
    # the split layer calls so far, by which each seeds its chunks' random states (SequenceSplit.place): a copy of the
    # model carries on from its count, so a copy made before a step draws that step's numbers again
    split_draws: Iterator[int] = dataclasses.field(default_factory=itertools.count, compare=False)

    def final_norm(self) -> nn.Module | None:
        """The final norm the decoder holds now, where the probe found its final norm to be its last step and the
        module there is still a row-wise norm (:func:`~.model_parts.final_norm`); else ``None``."""
        return None if self.norm_name is None else final_norm(self.decoder, self.norm_name)

    @property
    def kernel_apart(self) -> bool:
        """Whether some stream layer's own attention keeps a packed row's documents apart whatever its mask says."""
        return any(facts.kernel_apart for facts in self.facts)

    def check_decoder(self, lm: nn.Module) -> None:
        """Refuse a causal LM ``lm`` whose decoder is no longer the one the engine was installed on (replaced or
        removed since), naming it and the fix."""
        try:
            live = lm.get_submodule(self.decoder_path)
        except AttributeError:
            live = None
        if live is not self.decoder:
            what = "removed" if live is None else f"replaced by a {type(live).__name__}"
            refuse(lm, f"its decoder `{self.decoder_path}` was {what} after enable_streambp; {_AGAIN}")

    def check_layers(self) -> None:
        """Refuse a decoder whose stream layers are no longer those the engine installed its hooks on: a layer
        replaced, removed or added since, which would run without streaming or not at all. Names the first
        difference and the fix. (A walk over the decoder's modules: a few milliseconds for thousands of them.)"""
        live = named_decoder_layers(self.decoder)
        if len(live) == len(self.layers) and all(a is b for (_, a), b in zip(live, self.layers, strict=True)):
            return
        installed = {id(layer) for layer in self.layers}
        names = {id(layer): name for name, layer in live}
        added = next((name for name, layer in live if id(layer) not in installed), None)
        gone = next((layer for layer in self.layers if id(layer) not in names), None)
        if added is not None and gone is not None:
            what = f"the decoder layer `{added}` is not the {type(gone).__name__} the engine streams there (replaced)"
        elif added is not None:
            what = f"the decoder layer `{added}` was added"
        elif gone is not None:
            what = f"a {type(gone).__name__} decoder layer was removed"
        else:
            what = "its decoder layers were reordered"
        refuse(self.decoder, f"{what} after enable_streambp; {_AGAIN}")

    def call_for(
        self, inputs: torch.Tensor | None, rebuildable: bool, ranks: int = 1, masks: MaskBlocks = NO_MASKS
    ) -> DecoderCall:
        """The :class:`~streambp_trl.layers.DecoderCall` of a streamed decoder call on ``inputs`` (batch, T, ...),
        ``rebuildable``: its layer inputs may be rebuilt in backward (no hidden states kept), carrying the call's
        resolved plan: the planner's where anything is planned, else the user's choices
        (:meth:`~streambp_trl.sizing.choices.PlanChoices.fixed`). Without a recognisable input (no length to plan
        for) the call carries no plan, and each layer takes the user's choices at the rule of thumb for its length.
        ``ranks``: the rows are one rank's share of rows split across that many (the plan counts the split's
        buffers); ``masks``: the attention mask blocks its layers build (:mod:`.mask_blocks`)."""
        choices = self.options.choices
        call = functools.partial(
            DecoderCall, inputs_rebuildable=rebuildable, offloader=self.offloader, layers=len(self.layers)
        )
        if inputs is None or inputs.dim() < 2:  # (with nothing planned the chunk is fixed: no length is needed)
            return call(plan=None if self.auto is not None else choices.fixed(0))
        if self.auto is None:
            plan = choices.fixed(inputs.shape[1])
            self._say_fixed(tuple(inputs.shape[:2]), plan)
            return call(plan=plan)
        rows, seq_len = inputs.shape[:2]
        plan = self.auto.plan(rows, seq_len, inputs.device, self._layouts_open(rebuildable), ranks, masks)
        return call(plan=plan)

    def _layouts_open(self, rebuildable: bool) -> bool:
        """Whether a plan may rebuild layer inputs: the call keeps no hidden states (``rebuildable``), each layer's
        parameters are whole here (not ZeRO-3 or FSDP) and the memory model counts the layers the engine streams."""
        counted = self.auto is not None and self.auto.shape is not None and self.auto.shape.layers == len(self.layers)
        return rebuildable and counted and sharded_module(self.decoder) is None

    def check_fits(self, rows: int, seq_len: int, device: torch.device, padded: bool = False) -> None:
        """Raise :class:`~streambp_trl.sizing.auto.NoPlanFits` where a training call on ``rows`` x ``seq_len``
        tokens fits no plan in the memory its first step would have (nothing planned: nothing checked); ``padded``:
        its rows are padded or packed, so its layers build mask blocks over the whole prefix (and the windowed
        layers theirs, whatever the rows: :func:`.mask_blocks.model_window`)."""
        if self.auto is not None:
            masks = MaskBlocks(whole=padded, window=model_window(self.decoder.config))
            self.auto.check(rows, seq_len, device, self._layouts_open(True), masks)

    def _say_fixed(self, shape: tuple[int, int], plan: StepPlan) -> None:
        """At info level, once per call shape (rows, T): how a call runs where every choice is fixed and no budget
        is given (nothing planned, nothing checked against memory), in the words of a plan."""
        if shape in self.fixed_said:
            return
        self.fixed_said.add(shape)
        logger.info(
            f"StreamBP plan for {plan.describe(shape[0] * shape[1], len(self.layers))}, as configured (no "
            "memory_budget: not checked against memory)."
        )

    def say_if_unstreamed(self, inputs: torch.Tensor | None, chunk: int | None) -> None:
        """One warning, the first time a call with gradients runs its whole sequence as one chunk (``chunk`` tokens
        or more): each layer is then checkpointed whole, as Hugging Face's checkpointing would, and nothing is
        streamed. Names why (the fixed chunk, or what ``"auto"`` chose) and the setting to change."""
        if self.unstreamed_said or chunk is None or inputs is None or inputs.dim() < 2 or inputs.shape[1] > chunk:
            return
        self.unstreamed_said = True
        length = inputs.shape[1]
        if self.options.stream_chunk_size == AUTO:
            why = (
                f"stream_chunk_size='auto' chose one chunk of {chunk} tokens, as the memory model finds the whole "
                "sequence fits memory_budget (or the free memory)"
            )
            fix = f"set stream_chunk_size to fewer than {length} tokens"
        else:
            why = f"it is no longer than stream_chunk_size={chunk}"
            fix = f"set stream_chunk_size below {length}, or train longer sequences (max_length)"
        logger.warning(
            f"StreamBP: a {length}-token sequence is not streamed: {why}; its decoder layers are checkpointed whole, "
            f"which saves nothing over Hugging Face's checkpointing. To stream, {fix}. (Said once; later calls "
            "whose sequence fits one chunk are not streamed either.)"
        )

    def logits_tile(self, hidden: torch.Tensor) -> int:
        """Tokens per tile of the logit kernel for the (batch, T, hidden) states ``hidden``."""
        if self.options.logits_chunk_size != AUTO:
            return self.options.logits_chunk_size
        return self.auto.choose(hidden.shape[0], hidden.shape[1], hidden.device)

    def last_chunk_sizes(self) -> tuple[int | None, int | None]:
        """``(stream, logits)`` chunk sizes of the latest call (fixed ones, or what "auto" chose last)."""
        stream, logits = self.options.stream_chunk_size, self.options.logits_chunk_size
        last = self.auto.last if self.auto is not None else None
        return (last if stream == AUTO else stream), (last if logits == AUTO else logits)

    def logit_gradient_form(
        self, lm: nn.Module, head: nn.Linear, n: int, tile: int, device: torch.device, token_mean: bool
    ) -> HeadForm:
        """The form of the logit kernel's gradient for a call scoring ``n`` rows in tiles of ``tile``
        (:func:`~streambp_trl.sizing.room.head_form`, by the planner's room within the budget, with the optimizer
        state it counts and, where the device has no allocation figure, the forms the latest plan fits):
        ``EAGER`` only when the call's loss is a token mean (``token_mean``), else ``FUSED`` or ``TWO_NODE``. A change
        of form is logged (at info level)."""
        forms = tuple(HeadForm) if token_mean else (HeadForm.TWO_NODE, HeadForm.FUSED)
        auto, state, planned = self.auto, (0, 0), None
        if auto is not None:
            state = auto.optimizer_state() if torch.is_grad_enabled() else (0, 0)
            planned = auto.last_plan.head_forms if auto.last_plan is not None else None
        form = head_form(lm, head, n, tile, self.options.choices.budget, device, forms, state, planned)
        if form != self.head_form:
            logger.info(f"StreamBP: the logit kernel's gradient for {n} scored rows takes the {form} form.")
        self.head_form = form
        return form
