"""The training objectives, each declared once: its command name, its ``Stream*Config`` / ``Stream*Trainer`` pair and
what its trainer takes beyond TRL's common arguments. The command line (its commands, their help, their script
arguments and checks) reads :data:`OBJECTIVES`."""

from __future__ import annotations

import dataclasses

from .distillation_config import StreamDistillationConfig
from .distillation_trainer import StreamDistillationTrainer
from .dpo_config import StreamDPOConfig
from .dpo_trainer import StreamDPOTrainer
from .grpo_config import StreamGRPOConfig
from .grpo_trainer import StreamGRPOTrainer
from .kto_config import StreamKTOConfig
from .kto_trainer import StreamKTOTrainer
from .reward_config import StreamRewardConfig
from .reward_trainer import StreamRewardTrainer
from .rloo_config import StreamRLOOConfig
from .rloo_trainer import StreamRLOOTrainer
from .sft_config import StreamSFTConfig
from .sft_trainer import StreamSFTTrainer


@dataclasses.dataclass(frozen=True)
class Objective:
    """One objective. ``name``: its command (``streambp-trl sft``), as TRL's (``trl sft``); ``purpose``: what it
    trains, in a few words; ``rewards``: its trainer scores generated completions with reward functions and/or a
    reward model (``reward_funcs``, ``reward_model_name_or_path``); ``teacher``: it distils a teacher
    (``teacher_model_name_or_path``); ``classifier``: it trains a sequence classifier (LoRA's task type SEQ_CLS)."""

    name: str
    config: type
    trainer: type
    purpose: str
    rewards: bool = False
    teacher: bool = False
    classifier: bool = False

    @property
    def help(self) -> str:
        """The command's one-line help."""
        extra = "`reward_funcs`, " if self.rewards else "`teacher_model_name_or_path`, " if self.teacher else ""
        trl = f"TRL's `trl {self.name}` arguments"
        return f"{self.purpose} with {self.trainer.__name__} ({trl}, {extra}the stream options)."


OBJECTIVES: dict[str, Objective] = {
    objective.name: objective
    for objective in (
        Objective("sft", StreamSFTConfig, StreamSFTTrainer, "Supervised fine-tuning"),
        Objective("dpo", StreamDPOConfig, StreamDPOTrainer, "Preference training"),
        Objective("kto", StreamKTOConfig, StreamKTOTrainer, "Unpaired preference training"),
        Objective("grpo", StreamGRPOConfig, StreamGRPOTrainer, "Online RL", rewards=True),
        Objective("rloo", StreamRLOOConfig, StreamRLOOTrainer, "Online RL", rewards=True),
        Objective("reward", StreamRewardConfig, StreamRewardTrainer, "Reward modelling", classifier=True),
        Objective(
            "distillation", StreamDistillationConfig, StreamDistillationTrainer, "Distillation from a teacher",
            teacher=True,
        ),
    )
}  # fmt: skip
