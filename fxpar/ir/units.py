"""Sizes written as text: ``"80GB"`` (powers of 1000), ``"2GiB"`` (powers of 1024), ``"512 MB"``, ``1e9``. The
one reader of them (``memory_per_rank``, ``max_shard_size``).

Reads: the value. Writes nothing.
"""

from __future__ import annotations

import re

from fxpar.ir.errors import PlanError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | float | str | None, what: str = "memory per rank", *, bits: bool = False) -> int | None:
    """Bytes in ``value``: a number, or a number and a unit of :data:`UNITS` (case ignored); None stays None.
    ``bits``: a unit ending in a lower-case ``b`` counts bits, as ``save_pretrained`` reads ``max_shard_size``
    (``"8Mb"``: 10**6 bytes). A PlanError naming ``what`` and the units otherwise."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2) if match else None
    if unit is None or unit.lower() not in UNITS:
        raise PlanError(f"{what} {value!r}: write a number of bytes or a size like '80GB' or '80GiB' "
                        f"(units: {', '.join(u for u in UNITS if u)})")
    per_bit = bits and unit.endswith("b")
    return int(float(match.group(1)) * UNITS[unit.lower()] // (8 if per_bit else 1))
