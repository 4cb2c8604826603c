"""Sizes in bytes: parsing ``78GiB`` / ``80GB`` / ``512MiB``, budgets, and GiB for reports."""

from __future__ import annotations

import re

GiB = 2**30


UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
UNITS.update({f"{p}ib": v for p, v in list(UNITS.items()) if p not in ("", "b")})
UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_size(text: str | int, *, unit_required: bool = False) -> int:
    """Bytes of a size: ``80GiB`` / ``80G`` (binary), ``78GB`` (decimal), ``512MiB``, ``1.5TiB``, ``4096`` (bytes;
    with ``unit_required``, a number without a unit is refused: ``80`` is far more likely 80 GiB than 80 bytes)."""
    if isinstance(text, int) and not isinstance(text, bool) and not unit_required:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*", str(text), re.IGNORECASE)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 78GB, 512MiB, 4096)")
    if unit_required and not unit:
        number = match.group(1)
        raise ValueError(f"{str(text)!r} has no unit: write {number}GiB (binary), {number}GB (decimal) or {number}MiB")
    return int(float(match.group(1)) * UNITS[unit])


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


def size_text(n_bytes: float) -> str:
    """A size for people: ``41.2 GiB``, ``96.0 MiB`` or ``12.5 KiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 2**10:.1f} KiB"


def parse_budget(value: str | int) -> int:
    """A memory budget in bytes: a positive size with its unit (``parse_size``; ``80`` is refused, as 80 bytes is
    never meant, ``4096B`` is bytes), else ``ValueError`` saying what to give."""
    try:
        budget = parse_size(value, unit_required=True)
    except ValueError as e:
        raise ValueError(f"memory_budget: {e}") from None
    if budget <= 0:
        raise ValueError(f"memory_budget must be a positive size such as '78GiB', got {value!r}.")
    return budget
