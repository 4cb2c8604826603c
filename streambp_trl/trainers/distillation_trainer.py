"""``StreamDistillationTrainer``: TRL's ``DistillationTrainer`` with the student and the teacher streamed and the
divergence computed tile by tile."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from trl import DistillationTrainer

from ..engine import decode_for_head, enable_streambp, kernel_head, logit_gradient_form, logits_tile
from ..engine.head_side import engine_state
from ..engine.lm_forward import logit_transform
from ..engine.model_parts import causal_lm
from ..engine.whole_rows import Share, sharing
from ..engine.zero3 import zero3_gathered
from ..logits import chunked_divergence
from .distillation_config import StreamDistillationConfig
from .mixin import StreamGeneratingMixin

# what TRL's DistillationTrainer puts in a batch for a vision-language model's forward, besides the token ids
_MULTIMODAL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """An LM head parameter as one tensor: a sharded FSDP2 ``DTensor`` (a teacher outside its forward) gathered."""
    if isinstance(tensor, torch.distributed.tensor.DTensor):
        return tensor.full_tensor()
    return tensor


class StreamDistillationTrainer(StreamGeneratingMixin, DistillationTrainer):
    """Drop-in for [`~trl.DistillationTrainer`]; accepts a [`StreamDistillationConfig`] or a plain
    [`~trl.DistillationConfig`].

    Generation (on-policy, with `temperature`, `top_k`, `top_p`, `min_p`), batching, gradient accumulation, LoRA and
    the logged metrics are TRL's own. The loss is TRL's generalised JSD (`beta`, `temperature`) between the student's
    and the teacher's next-token distributions on the completion tokens, computed from:

    * the student's decoder streamed chunk by chunk (the stream engine);
    * the teacher's no-grad forward streamed chunk by chunk (`stream_eval`): a separate model, of its own width,
      sharing the student's vocabulary; only its last hidden states are kept;
    * [`~streambp_trl.logits.chunked_divergence`] on both models' hidden states and LM heads, tile by tile over
      tokens (`logits_chunk_size`) and vocabulary, each model's final norm applied there, so neither model's
      (tokens x vocab) logits exist.

    Memory per token beyond the engine's (each student layer's input): the student's last hidden state and the
    teacher's, and in backward the gradient of the student's.
    """

    config_class = StreamDistillationConfig

    def __init__(self, model, teacher_model=None, args=None, *pos, **kwargs):
        if teacher_model is None:
            raise ValueError(
                "StreamDistillationTrainer needs a teacher: pass `teacher_model` (a Hub name, a local directory or "
                "a PreTrainedModel sharing the student's vocabulary), e.g. "
                "`teacher_model=args.teacher_model_name_or_path`."
            )
        super().__init__(model, teacher_model, self._stream_args(args, model), *pos, **kwargs)
        teacher = dataclasses.replace(self.stream_options, fused_outputs=("log_probs",))
        group = self.sequence_group  # (the teacher streams the same share)
        enable_streambp(
            self.accelerator.unwrap_model(self.teacher_model),
            teacher,
            sequence_group=group,
            whole_rows=group is not None,
        )

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        """TRL's divergence loss on this micro-batch: ``(loss, entropy sum (detached), number of scored tokens)``.

        Position ``P - 1 + k`` of prompt + completion (``P`` prompt columns) predicts completion token ``k``; the
        scored rows are those whose completion (and tool) mask is set. The loss is the sum of their divergences over
        ``num_items_in_batch`` (or, without it, over their number).

        With the sequence split across ranks (whole rows on every rank), the student and the teacher stream this
        rank's share, the divergences of its scored positions are summed, and the sums of every rank are added (a
        differentiable all-reduce), so every rank has the whole rows' loss.
        """
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        loss_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        model_inputs = {
            "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            "use_cache": False,
            **{key: inputs[key] for key in _MULTIMODAL_INPUTS if key in inputs},
        }
        # each model's decoder streamed, its final norm left to the divergence kernel where decode_for_head says so
        student = causal_lm(unwrapped_student)
        group = self.sequence_group() if self.splits_sequences and unwrapped_student.training else None
        share = Share.of(group, model_inputs, engine_state(student)) if group is not None else None
        called = share.kwargs if share is not None else model_inputs
        with sharing(share.split) if share is not None else contextlib.nullcontext():
            student_side = decode_for_head(student, lambda: student.base_model(**called))
            hidden, norm = student_side.hidden, student_side.norm
            self.teacher_model.eval()
            unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
            teacher = causal_lm(unwrapped_teacher)
            with torch.no_grad():
                teacher_side = decode_for_head(
                    teacher,
                    lambda: self._forward_redirection(
                        self.teacher_model, unwrapped_teacher, lambda: teacher.base_model(**called)
                    ),
                )
        teacher_hidden, teacher_norm = teacher_side.hidden, teacher_side.norm
        s_head, t_head = kernel_head(student), kernel_head(teacher)
        if s_head.weight.device != t_head.weight.device:
            raise ValueError(
                f"The student's lm_head is on {s_head.weight.device} and the teacher's on {t_head.weight.device}: the "
                "divergence compares them tile by tile. Place both on one device (their `device_map`)."
            )
        device = s_head.weight.device
        batch, length = model_inputs["input_ids"].shape
        start = prompt_ids.shape[1] - 1
        valid = loss_mask.to(device) != 0
        scored = torch.zeros(batch, length, dtype=torch.bool, device=device)
        scored[:, start : length - 1] = valid  # (the positions whose next token is a scored completion token)
        if share is not None:  # this rank's positions of the rows (right-padded to a multiple of the ranks)
            split = share.split
            scored = F.pad(scored, (0, split.length * split.size - length))[:, share.mine]
        width = scored.shape[1]
        norm_params = [p for n in (norm, teacher_norm) if n is not None for p in n.parameters()]
        s_softcap, s_scale = logit_transform(student.config.get_text_config())
        t_softcap, t_scale = logit_transform(teacher.config.get_text_config())
        rows = torch.arange(batch * width, device=device).view(batch, width)[scored]
        tile = logits_tile(student, hidden)
        # the weight's gradient in the hidden states' sweep where its (V, H) float32 accumulator fits, else apart
        form = logit_gradient_form(student, s_head, rows.shape[0], tile, device, token_mean=False)
        divergence, entropy = chunked_divergence(
            hidden.to(device).reshape(batch * width, -1),
            _whole(s_head.weight),
            _whole(s_head.bias),
            teacher_hidden.to(device).reshape(batch * width, -1),
            _whole(t_head.weight),
            _whole(t_head.bias),
            beta=self.beta,
            rows=rows,
            norm=norm,
            teacher_norm=teacher_norm,
            temperature=self.temperature,
            student_softcap=s_softcap,
            student_logit_scale=s_scale,
            teacher_softcap=t_softcap,
            teacher_logit_scale=t_scale,
            token_chunk=tile,
            gathered=zero3_gathered([s_head.weight, s_head.bias, t_head.weight, t_head.bias, *norm_params]),
            form=form,
        )
        num_valid = valid.sum()
        if num_items_in_batch is None:
            denominator = num_valid.clamp(min=1)
        else:
            denominator = num_items_in_batch.to(device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        total, entropy_sum = divergence.sum(), entropy.sum().detach()
        if share is not None:  # every rank's scored positions (its gradient: every rank's loss's, R times its share's)
            total = dist_nn.all_reduce(total, group=group)
            dist.all_reduce(entropy_sum, group=group)
        return total / denominator, entropy_sum, num_valid
