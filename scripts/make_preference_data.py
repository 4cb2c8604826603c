"""Write the shipped preference datasets, derived from ``configs/data/tiny_prompt_completion.jsonl``.

* ``configs/data/tiny_preference.jsonl``: paired preferences for DPO, ``{"prompt", "chosen", "rejected"}``: the
  chosen completion is the example's own answer, the rejected one the answer of another example.
* ``configs/data/tiny_unpaired_preference.jsonl``: unpaired preferences for KTO, ``{"prompt", "completion",
  "label"}``: every example once with its own answer (``true``) and once with another example's (``false``).

    python scripts/make_preference_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "configs" / "data"


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = [json.loads(line) for line in (DATA / "tiny_prompt_completion.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    others = list(range(len(rows)))
    rng.shuffle(others)
    paired, unpaired = [], []
    for i, row in enumerate(rows):
        j = others[i] if others[i] != i else (i + 1) % len(rows)
        wrong = rows[j]["completion"]
        paired.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": wrong})
        unpaired.append({"prompt": row["prompt"], "completion": row["completion"], "label": True})
        unpaired.append({"prompt": row["prompt"], "completion": wrong, "label": False})
    for name, data in (("tiny_preference.jsonl", paired), ("tiny_unpaired_preference.jsonl", unpaired)):
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"wrote {len(data)} rows to configs/data/{name}")


if __name__ == "__main__":
    main()
