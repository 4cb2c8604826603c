#!/usr/bin/env python
"""Write ``configs/tiny_teacher/``: the teacher of the offline distillation run (``configs/distillation_tiny.yaml``).

A randomly initialised two-layer ``Qwen3ForCausalLM`` (``torch.manual_seed(1)``) wider than the student in
``configs/tiny_model`` (hidden size 96 against 64, 6 query / 2 key-value heads of size 16, MLP 128, tied embeddings),
sharing its tokenizer's vocabulary and special tokens (read from ``configs/tiny_model``, which
``scripts/make_tiny_assets.py`` writes first). Stored in bfloat16 (about 350 KB); load it with ``dtype=float32`` to
train next to the float32 student. Deterministic: re-running rewrites the same files. No tokenizer is written: the
distillation trainer tokenizes with the student's.

Usage::

    python scripts/make_tiny_teacher.py                 # writes configs/tiny_teacher/
    python scripts/make_tiny_teacher.py --root /tmp/x   # reads /tmp/x/configs/tiny_model, writes /tmp/x/configs/...
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_teacher(student_dir: Path) -> Qwen3ForCausalLM:
    """The wider random Qwen3 with the student's vocabulary, special token ids and generation config."""
    student = AutoConfig.from_pretrained(student_dir)
    config = Qwen3Config(
        vocab_size=student.vocab_size,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=student.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=student.pad_token_id,
        bos_token_id=student.bos_token_id,
        eos_token_id=student.eos_token_id,
        attention_dropout=0.0,
    )
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig.from_pretrained(student_dir)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="read and write under ROOT/configs")
    args = parser.parse_args(argv)
    student_dir = args.root / "configs" / "tiny_model"
    teacher_dir = args.root / "configs" / "tiny_teacher"
    model = build_teacher(student_dir)
    if teacher_dir.exists():  # start clean, so no file from an earlier layout survives
        shutil.rmtree(teacher_dir)
    model.save_pretrained(teacher_dir, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    assert reloaded.config.vocab_size == AutoConfig.from_pretrained(student_dir).vocab_size
    for path in sorted(teacher_dir.iterdir()):
        print(f"{path.stat().st_size:>9,d} B  {path.relative_to(args.root)}")
    print(f"{sum(p.numel() for p in model.parameters()):,d} parameters")


if __name__ == "__main__":
    main()
