"""Reward functions for ``streambp-trl grpo`` / ``rloo`` runs, in TRL's reward-function signature.

A YAML config names reward functions in ``reward_funcs``: one of these by name, one of TRL's (``accuracy_reward``,
``think_format_reward``, ``reasoning_accuracy_reward``), or any dotted import path (``my_lib.rewards.my_reward``).
"""

from __future__ import annotations


def _text(completion) -> str:
    """A completion as text: standard completions are strings, conversational ones lists of messages."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def length_reward(completions, target_chars: int = 40, **kwargs) -> list[float]:
    """``1 - |len - target| / target`` (at least -1): prefers completions of about ``target_chars`` characters."""
    return [max(-1.0, 1.0 - abs(len(_text(c)) - target_chars) / target_chars) for c in completions]


def sentence_format_reward(completions, **kwargs) -> list[float]:
    """1.0 for a completion that is one short sentence ending in a period on its first line, else 0.0."""
    rewards = []
    for completion in completions:
        first_line = _text(completion).strip().split("\n", 1)[0]
        rewards.append(1.0 if first_line.endswith(".") and first_line.count(".") == 1 else 0.0)
    return rewards


REWARDS = {"length_reward": length_reward, "sentence_format_reward": sentence_format_reward}
