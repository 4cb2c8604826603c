#!/usr/bin/env python
"""Write the offline assets for the tiny default SFT run: three tiny data sets, a tokenizer and a tiny model.

Everything is generated locally (nothing is downloaded) and deterministically, so re-running the script rewrites
the same files:

* ``configs/data/tiny_chat.jsonl``: conversational examples in TRL's format
  ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``. Most have one
  user/assistant exchange, some two, a few start with a system message.
* ``configs/data/tiny_prompt_completion.jsonl``: standard (not conversational) prompt-completion examples
  ``{"prompt": "Question: ...\\nAnswer:", "completion": " ..."}``. The completion starts with a space after the
  prompt's closing colon, so the tokenized prompt is a prefix of the tokenized prompt+completion (TRL checks it).
* ``configs/data/tiny_text.jsonl``: language-modelling examples ``{"text": "Question: ...\\nAnswer: ..."}``.
* ``configs/tiny_model/``: a byte-level BPE tokenizer (vocabulary of ``--vocab-size`` tokens, Qwen2-style
  pre-tokenizer that splits digits one by one) trained on the texts above and saved as a transformers
  ``PreTrainedTokenizerFast``, with ``<|endoftext|>`` (eos and pad), ``<|im_start|>`` and ``<|im_end|>`` and a
  ChatML chat template whose assistant turns are wrapped in ``{% generation %}...{% endgeneration %}`` (for TRL's
  ``assistant_only_loss=True``); and a randomly initialised two-layer ``Qwen3ForCausalLM`` (hidden size 64, tied
  embeddings, float32, ``torch.manual_seed(0)``) with its generation config.

All examples come from small templated tasks (arithmetic, word reversal, counting, capital letters, sorting, ...)
drawn with ``random.Random(seed)``. The script checks what it wrote before it exits: the tokenizer and the model
reload offline, and the chat template's assistant mask covers exactly the assistant replies and their
``<|im_end|>``.

Usage::

    python scripts/make_tiny_assets.py                 # writes configs/data/*.jsonl and configs/tiny_model/
    python scripts/make_tiny_assets.py --root /tmp/x   # writes /tmp/x/configs/...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML, as Qwen uses it, without a default system prompt. Every assistant turn's content and its <|im_end|> sit
# inside {% generation %} (the newline after <|im_end|> and the "<|im_start|>assistant\n" header do not), so
# `return_assistant_tokens_mask=True` marks exactly the tokens the model must learn to produce, end-of-turn included.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- generation -%}\n"
    "{{- message['content'] + '<|im_end|>' -}}\n"
    "{%- endgeneration -%}\n"
    "{{- '\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

# Qwen2's pre-tokenizer pattern: letters with one optional leading non-letter, digits one at a time, punctuation runs,
# newlines kept apart from the letters that follow them.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = [
    "apple", "banana", "cherry", "garden", "planet", "river", "mountain", "window", "pencil", "rocket",
    "yellow", "orange", "purple", "silver", "forest", "island", "candle", "button", "dragon", "castle",
    "bridge", "summer", "winter", "autumn", "spring", "coffee", "butter", "ladder", "rabbit", "turtle",
    "bottle", "letter", "number", "little", "middle", "pepper", "mirror", "jacket", "basket", "bucket",
    "cat", "dog", "sun", "moon", "star", "tree", "book", "lamp", "door", "fish",
    "bird", "cake", "ship", "road", "rain", "snow", "wind", "fire", "stone", "cloud",
    "music", "paper", "table", "chair", "house", "horse", "mouse", "tiger", "zebra", "lemon",
]  # fmt: skip

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "You answer small puzzles about words and numbers.",
]

Task = Callable[[random.Random], tuple[str, str]]


def _sentence(rng: random.Random, low: int = 2, high: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def task_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def task_subtract(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."


def task_multiply(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def task_reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f'Reverse the word "{word}".', f'"{word[::-1]}"'


def task_length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f'How many letters are in the word "{word}"?', f'The word "{word}" has {len(word)} letters.'


def task_count_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    letter = rng.choice(word)
    count = word.count(letter)
    times = "time" if count == 1 else "times"
    return (
        f'How many times does the letter "{letter}" appear in "{word}"?',
        f'The letter "{letter}" appears {count} {times} in "{word}".',
    )


def task_upper(rng: random.Random) -> tuple[str, str]:
    text = _sentence(rng)
    return f"Write this in capital letters: {text}", text.upper()


def task_title(rng: random.Random) -> tuple[str, str]:
    text = _sentence(rng)
    return f"Capitalize the first letter of each word: {text}", text.title()


def task_count_up(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 50)
    stop = start + rng.randint(2, 15)
    return f"Count from {start} to {stop}.", ", ".join(str(n) for n in range(start, stop + 1))


def task_count_down(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(5, 60)
    stop = max(0, start - rng.randint(2, 12))
    return f"Count down from {start} to {stop}.", ", ".join(str(n) for n in range(start, stop - 1, -1))


def task_sort(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
    shown = ", ".join(str(n) for n in numbers)
    return f"Sort these numbers from smallest to largest: {shown}", ", ".join(str(n) for n in sorted(numbers))


def task_larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    return f"Which number is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


def task_spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f'Spell the word "{word}" letter by letter.', "-".join(word)


def task_first_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f'What is the first letter of "{word}"?', f'The first letter of "{word}" is "{word[0]}".'


def task_parity(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 999)
    return f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."


TASKS: list[Task] = [
    task_add,
    task_subtract,
    task_multiply,
    task_reverse,
    task_length,
    task_count_letter,
    task_upper,
    task_title,
    task_count_up,
    task_count_down,
    task_sort,
    task_larger,
    task_spell,
    task_first_letter,
    task_parity,
]


def _exchanges(rng: random.Random) -> list[tuple[str, str]]:
    """One or two (question, answer) pairs: about a third of the examples have two."""
    return [rng.choice(TASKS)(rng) for _ in range(1 if rng.random() < 0.65 else 2)]


def make_chat(rng: random.Random, n: int) -> list[dict[str, list[dict[str, str]]]]:
    """Conversational examples: ``{"messages": [...]}``, one in ten opening with a system message."""
    examples = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.1:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for question, answer in _exchanges(rng):
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        examples.append({"messages": messages})
    return examples


def make_prompt_completion(rng: random.Random, n: int) -> list[dict[str, str]]:
    """Standard prompt-completion examples; with two exchanges the first one is part of the prompt."""
    examples = []
    for _ in range(n):
        pairs = _exchanges(rng)
        context = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in pairs[:-1])
        question, answer = pairs[-1]
        examples.append({"prompt": f"{context}Question: {question}\nAnswer:", "completion": f" {answer}"})
    return examples


def make_text(rng: random.Random, n: int) -> list[dict[str, str]]:
    """Language-modelling examples: one or two question/answer blocks in plain text."""
    return [{"text": "\n\n".join(f"Question: {q}\nAnswer: {a}" for q, a in _exchanges(rng))} for _ in range(n)]


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def corpus(chat: list[dict], prompt_completion: list[dict], text: list[dict]) -> Iterator[str]:
    """The strings the tokenizer is trained on: every field of every example, plus the chat role names."""
    yield "system\nuser\nassistant\n"
    for example in chat:
        for message in example["messages"]:
            yield message["content"]
    for example in prompt_completion:
        yield example["prompt"] + example["completion"]
    for example in text:
        yield example["text"]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE in Qwen2's layout (NFC, regex split, byte-level), wrapped as a transformers fast tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A two-layer Qwen3 with random weights (``torch.manual_seed(0)``), float32, tied embeddings."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=eos_id,  # as in Qwen: no BOS is prepended, the config's bos id is <|endoftext|>
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    # Chat generation stops at the end of the assistant turn; plain-text generation at <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def check_assets(model_dir: Path, chat: list[dict]) -> None:
    """Reload the tokenizer and model from disk and check the assistant masks of every chat example."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer), "embedding rows != tokenizer size"
    for example in chat:
        messages = example["messages"]
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        masked = [i for i, m in zip(ids, mask, strict=True) if m]
        expected = "".join(m["content"] + IM_END for m in messages if m["role"] == "assistant")
        got = tokenizer.decode(masked)
        assert got == expected, f"assistant mask covers {got!r}, expected {expected!r}"
        assert masked.count(im_end_id) == sum(m["role"] == "assistant" for m in messages)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(chat[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"{IM_START}assistant\n"), prompt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="write under ROOT/configs (default: the repo)")
    parser.add_argument("--num-examples", type=int, default=300, help="examples per data file")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--seed", type=int, default=0, help="seed of the example generators")
    args = parser.parse_args(argv)

    data_dir = args.root / "configs" / "data"
    model_dir = args.root / "configs" / "tiny_model"

    # One generator per file, so changing one file's size leaves the others as they were.
    chat = make_chat(random.Random(args.seed), args.num_examples)
    prompt_completion = make_prompt_completion(random.Random(args.seed + 1), args.num_examples)
    text = make_text(random.Random(args.seed + 2), args.num_examples)
    write_jsonl(data_dir / "tiny_chat.jsonl", chat)
    write_jsonl(data_dir / "tiny_prompt_completion.jsonl", prompt_completion)
    write_jsonl(data_dir / "tiny_text.jsonl", text)

    tokenizer = train_tokenizer(corpus(chat, prompt_completion, text), args.vocab_size)
    model = build_model(tokenizer)
    if model_dir.exists():  # start clean, so no file from an earlier layout survives
        shutil.rmtree(model_dir)
    tokenizer.save_pretrained(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)

    check_assets(model_dir, chat)
    for path in sorted([*data_dir.glob("tiny_*.jsonl"), *model_dir.iterdir()]):
        print(f"{path.stat().st_size:>9,d} B  {path.relative_to(args.root)}")
    print(f"vocab {len(tokenizer)}, {sum(p.numel() for p in model.parameters()):,d} parameters")


if __name__ == "__main__":
    main()
