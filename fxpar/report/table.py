"""The per-module table: params, forward/backward FLOPs, activation bytes and share of the total.

Reads ``fxpar.module`` and ``fxpar.cost`` from every node (subgraphs included) and the program's
parameter table. A row aggregates a module and everything under it; tied parameters count once, under
their canonical FQN.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fxpar.ir import meta
from fxpar.ir.program import Program


@dataclass
class ModuleRow:
    module: str  # FQN, "" = the whole model
    depth: int
    params: int = 0
    param_bytes: int = 0
    flops: int = 0
    bwd_flops: int = 0
    activation_bytes: int = 0  # bytes written by the module's non-view nodes in one forward
    nodes: int = 0
    share: float = 0.0  # of the whole model's forward FLOPs

    def to_dict(self) -> dict:
        return asdict(self)


def _ancestors(fqn: str):
    """"" then every prefix of ``fqn`` down to itself: "a.b.c" -> "", "a", "a.b", "a.b.c"."""
    yield ""
    if fqn:
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):
            yield ".".join(parts[:i])


def module_rows(program: Program) -> dict[str, ModuleRow]:
    """Every module that owns a node or a parameter, with totals over its subtree, in first-use order."""
    rows: dict[str, ModuleRow] = {}

    def row(fqn: str) -> ModuleRow:
        if fqn not in rows:
            rows[fqn] = ModuleRow(fqn, 0 if not fqn else fqn.count(".") + 1)
        return rows[fqn]

    for node in program.nodes():
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        cost = node.meta.get(meta.COST, meta.ZERO_COST)
        for anc in _ancestors(node.meta.get(meta.MODULE, "")):
            r = row(anc)
            r.nodes += 1
            r.flops += cost.flops
            r.bwd_flops += cost.bwd_flops
            r.activation_bytes += cost.bytes_written
    for p in program.params.values():
        if p.is_buffer:
            continue
        for anc in _ancestors(p.module):
            r = row(anc)
            r.params += p.numel
            r.param_bytes += p.nbytes
    total = max(row("").flops, 1)
    for r in rows.values():
        r.share = r.flops / total
    return rows


def select_rows(rows: dict[str, ModuleRow], *, depth: int | None, module: str | None = None) -> list[ModuleRow]:
    """Rows under ``module`` (itself included) no deeper than ``depth`` levels below it, in tree order."""
    base = rows[module] if module else rows[""]
    out = []
    for fqn in sorted(rows, key=_tree_key):
        r = rows[fqn]
        if module and not (fqn == module or fqn.startswith(module + ".")):
            continue
        if depth is not None and r.depth - base.depth > depth:
            continue
        out.append(r)
    return out


def _tree_key(fqn: str):
    # numeric segments sort as numbers so layers.10 comes after layers.9
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in fqn.split(".")) if fqn else ()


def human(n: float, unit: str = "") -> str:
    for factor, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= factor:
            return f"{n / factor:.2f}{suffix}{unit}"
    return f"{int(n)}{unit}"


def format_rows(rows: list[ModuleRow]) -> str:
    header = ("module", "params", "fwd FLOPs", "bwd FLOPs", "act bytes", "share")
    lines = [header]
    for r in rows:
        name = ("  " * r.depth + r.module.rpartition(".")[2]) if r.module else "(total)"
        lines.append((name, human(r.params), human(r.flops), human(r.bwd_flops),
                      human(r.activation_bytes, "B"), f"{100 * r.share:5.1f}%"))
    return columns(lines, left=0)


def columns(lines: list[tuple[str, ...]], left: int) -> str:
    """Rows of cells as aligned text: the first row is the header, column ``left`` left-aligned."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(c.ljust(widths[j]) if j == left else c.rjust(widths[j]) for j, c in enumerate(line)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
