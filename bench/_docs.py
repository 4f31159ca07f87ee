"""Writing a benchmark's section of docs/benchmarks.md: replaced where it is, appended where it is not."""

from __future__ import annotations

import re
from pathlib import Path


def replace_section(path: str | Path, heading: str, text: str) -> None:
    """Put ``text`` (starting with the line ``heading``) in place of the section under ``heading``, which
    runs to the next heading of any level (so ``text`` must hold no sub-headings), or append it."""
    path = Path(path)
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    start = doc.find(f"\n{heading}\n")
    if start >= 0:
        nxt = re.search(r"\n#{1,3} ", doc[start + len(heading) + 2:])
        rest = doc[start + len(heading) + 2 + nxt.start():] if nxt else ""
        doc = doc[:start] + "\n" + text.strip("\n") + "\n" + rest
    else:
        doc = doc.rstrip("\n") + "\n\n" + text.strip("\n") + "\n"
    path.write_text(doc)
