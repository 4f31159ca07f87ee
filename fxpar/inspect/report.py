"""``fxpar.inspect(program)``: the module table, graphs and pictures, for people and for machines."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fxpar.inspect.graph import graph_text, write_picture
from fxpar.inspect.table import ModuleRow, format_rows, human, module_rows, select_rows
from fxpar.ir import meta
from fxpar.ir.program import Program


@dataclass
class Report:
    program: Program
    rows: dict[str, ModuleRow]
    depth: int | None = 3
    module: str | None = None
    pictures: list[Path] = field(default_factory=list)

    @property
    def total(self) -> ModuleRow:
        return self.rows[""]

    def table(self) -> str:
        return format_rows(select_rows(self.rows, depth=self.depth, module=self.module))

    def graph(self, module: str | None = None) -> str:
        return graph_text(self.program, module if module is not None else self.module)

    def header(self) -> str:
        p, t = self.program, self.total
        n_nodes = sum(1 for n in p.nodes() if n.op == "call_function")
        lines = [f"{p.info.model_class or 'model'} traced with frontend={p.frontend}: {n_nodes} ops, "
                 f"{human(t.params)} params, forward {human(t.flops)}FLOPs, backward {human(t.bwd_flops)}FLOPs"]
        for group in p.tied_groups():
            lines.append(f"tied: {' = '.join(group)}")
        return "\n".join(lines)

    def to_text(self) -> str:
        return self.header() + "\n\n" + self.table()

    def __str__(self) -> str:
        return self.to_text()

    def to_dict(self) -> dict:
        p = self.program
        info = p.info
        return {
            "model": info.model_class,
            "model_type": info.model_type,
            "frontend": p.frontend,
            "ops": sum(1 for n in p.nodes() if n.op == "call_function"),
            "total": self.total.to_dict(),
            "modules": [r.to_dict() for r in select_rows(self.rows, depth=self.depth, module=self.module)],
            "params": [{"fqn": q.fqn, "aliases": list(q.aliases), "shape": list(q.shape),
                        "dtype": str(q.dtype).replace("torch.", ""), "buffer": q.is_buffer}
                       for q in p.params.values()],
            "tied": [list(g) for g in p.tied_groups()],
            "hf": {"base_model_prefix": info.base_model_prefix, "tie_word_embeddings": info.tie_word_embeddings,
                   "tp_plan": info.tp_plan,
                   "pp_plan": {k: [list(a), list(b)] for k, (a, b) in (info.pp_plan or {}).items()},
                   "layer_container": info.layer_container, "num_layers": info.num_layers},
            "pictures": [str(x) for x in self.pictures],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def inspect(program: Program, *, module: str | None = None, depth: int | None = 3, graph: bool = False,
            picture: str | Path | None = None, file=None, quiet: bool = False) -> Report:
    """Print the module table of ``program`` (and its graph with ``graph=True``); return the :class:`Report`.

    ``module`` restricts the table and graph to one module's subtree; ``depth`` how many module levels
    below it the table shows (None: all); ``picture`` writes a DOT file (and SVG where graphviz is
    installed) with one cluster per module.
    """
    if not isinstance(program, Program):
        raise TypeError(f"fxpar.inspect takes a traced Program (fxpar.trace(...)), got {type(program).__name__}")
    if not any(meta.COST in n.meta for n in program.graph.nodes):
        raise ValueError("the program has no cost metadata; trace it with fxpar.trace")
    rows = module_rows(program)
    if module and module not in rows:
        raise KeyError(f"module {module!r} owns no node or parameter; top-level modules: "
                       f"{sorted(r for r in rows if r and '.' not in r)}")
    report = Report(program, rows, depth, module)
    if picture is not None:
        report.pictures = write_picture(program, picture, module)
    if not quiet:
        out = file or sys.stdout
        print(report.to_text(), file=out)
        if graph:
            print("\n" + report.graph(), file=out)
        for pic in report.pictures:
            print(f"wrote {pic}", file=out)
    return report
