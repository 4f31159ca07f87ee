"""``fxpar.inspect(program)``: the module table, graphs and pictures, for people and for machines."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fxpar.ir import meta
from fxpar.ir.program import Program
from fxpar.ir.rank_view import RankView, view_of
from fxpar.report import budget
from fxpar.report.collectives import collective_rows, format_collective_rows
from fxpar.report.context_parallel import cp_rows, cp_table
from fxpar.report.graph import graph_text, module_text, partition_dot, write_dot, write_picture
from fxpar.report.kernels import format_kernel_rows, kernel_rows
from fxpar.report.stages import format_stage_table, predicted_step, stage_rows
from fxpar.report.table import ModuleRow, format_rows, human, module_rows, select_rows
from fxpar.report.tp_coverage import coverage_of


@dataclass
class Report:
    program: Program
    rows: dict[str, ModuleRow]
    depth: int | None = 3
    module: str | None = None
    pictures: list[Path] = field(default_factory=list)
    compiled: RankView | None = None  # a compiled model on this rank (compiled.view()): adds the stage table

    @property
    def stages(self) -> list[dict]:
        if self.compiled is None:
            return []
        params = self.program.params
        return stage_rows(self.compiled.pipeline, lambda f: params[f].numel, self.compiled.mesh)

    def stage_table(self) -> str:
        c = self.compiled
        return format_stage_table(self.stages, predicted_step(c), c.schedule, c.microbatches)

    def collectives(self) -> list[dict]:
        """Per layer: collectives of this rank's program in forward and backward, and their bytes."""
        return collective_rows(self.program.gm)

    def tp_coverage(self):
        """Per module, what the TP plan cuts and leaves whole and why, the share per TP rank (None without TP)."""
        return coverage_of(self.compiled) if self.compiled is not None else None

    def collective_table(self) -> str:
        return format_collective_rows(self.collectives())

    def data_parallel(self) -> dict:
        """Buckets and memory per rank of a data-parallel / ZeRO plan; the engine's payload bytes of the
        last step (``measured_comm``, empty before a step; ZeRO-3's collectives are graph nodes)."""
        c = self.compiled
        if c is None or (c.plan.dp == 1 and not c.plan.zero):
            return {}
        measured = {}
        if c.plan.zero == 3:
            buckets = [{"stage": s, "params": len(b.names), "first": b.names[0], "bytes": b.shard_numel * b.dp *
                        b.shard.element_size(), "shard_bytes": b.shard_numel * b.shard.element_size()}
                       for s, bs in sorted(c.result.zero3_buckets.items()) for b in bs]
        else:
            e = c.data_parallel
            buckets = [{"params": b.params, "first": b.first, "bytes": b.bytes, "shard_bytes": b.shard_bytes}
                       for b in e.buckets]
            measured = {k: v for k, v in e.comm.items() if v}
        groups = {"shard": c.mesh.shard_group_name(), "replicate": c.mesh.replicate_group_name()}  # HSDP's two
        return {"zero": c.plan.zero, "dp": c.replicas, "dp_replicate": c.plan.dp_replicate, "groups": groups,
                "dp_shard": c.mesh.dp_shard,  # ranks of a shard group: dp / dp_replicate, times cp
                "buckets": buckets, "measured_comm": measured, "memory": c.memory}

    def data_parallel_table(self) -> str:
        d = self.data_parallel()
        lines = [f"data parallel: dp={d['dp']}, ZeRO-{d['zero']}, {len(d['buckets'])} buckets"]
        if d["dp_replicate"] > 1:
            r, g = d["dp_replicate"], d["groups"]
            lines[0] += (f"; HSDP: {r} replicas x shard groups of {d['dp_shard']} (this rank: shards over "
                         f"{g['shard']}, copies over {g['replicate']})")
        for i, b in enumerate(d["buckets"]):
            lines.append(f"  bucket {i}: {b['params']} params from {b['first']}, {human(b['bytes'])}B"
                         + (f", shard {human(b['shard_bytes'])}B" if b["shard_bytes"] else ""))
        lines.append(budget.format_memory(d["memory"]))
        return "\n".join(lines)

    def kernels(self) -> list[dict]:
        """fxpar's hand-written kernels this rank runs and the path each takes (``fxpar.report.kernels``)."""
        return kernel_rows(self.compiled) if self.compiled is not None else []

    def communication(self) -> list[dict]:
        """Predicted communication of one training step on this rank, every axis (empty for a trace)."""
        return budget.communication(self.compiled) if self.compiled is not None else []

    def activations(self) -> dict:
        """Predicted activation memory per rank under each recompute policy (``fxpar.cost.predict``)."""
        return budget.activations(self.program, self.compiled)

    def activation_table(self) -> str:
        c = self.compiled
        if c is None:
            users = {b.placeholder for b in self.program.inputs if b.kind == "user"}
            v = next((n.meta.get(meta.VAL) for n in self.program.graph.nodes if n.name in users
                      and getattr(n.meta.get(meta.VAL), "dim", lambda: 0)() == 2), None)
            shape = f" of {' x '.join(map(str, v.shape))}" if v is not None else ""
            return budget.format_activations(self.activations(), None, f" (one forward and backward{shape})")
        return budget.format_activations(self.activations(), c.plan.recompute,
                                         f" (pp rank {c.pp_rank}, {c.schedule}, {c.microbatches} microbatches)")

    def write_partition_picture(self, path) -> list:
        """A picture of the partitioned program: stages, their layers and collectives, the boundaries."""
        c = self.compiled
        title = f"{self.program.info.model_class or 'model'}: " + ", ".join(
            f"{k}={getattr(c.plan, k)}" for k in ("dp", "pp", "tp", "zero")) + f", {c.schedule}"
        return write_dot(partition_dot(self.stages, self.collectives(), title), path)

    def stage_graph(self, index: int) -> str:
        """The readable graph of pipeline stage ``index`` (parameters under their FQNs)."""
        return module_text(self.compiled.pipeline.stages[index].gm)

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
        c = self.compiled
        if c is not None:  # the rank's program: one microbatch, this TP rank's shards
            lines[0] += f" per microbatch{f' on one TP rank of {c.plan.tp}' if c.plan.tp > 1 else ''}"
        for group in p.tied_groups():
            lines.append(f"tied: {' = '.join(group)}")
        return "\n".join(lines)

    def to_text(self) -> str:
        text = self.header() + "\n\n" + self.table()
        if self.compiled is not None:
            c = self.compiled
            plan = c.plan
            text += (f"\n\npipeline: pp={plan.pp}, {len(c.pipeline.stages)} stages, schedule "
                     f"{c.schedule}, {c.microbatches} microbatches\n\n" + self.stage_table())
            text += "\n\n" + budget.format_flops(c)
            if plan.tp > 1:
                text += f"\n\ntensor parallel: tp={plan.tp}, collectives of this rank\n\n" + self.collective_table()
                cov = self.tp_coverage()
                text += "\n\n" + cov.to_text() if cov is not None else ""
            if plan.cp > 1:
                text += "\n\n" + cp_table(c)
            if plan.dp > 1 or plan.zero:
                text += "\n\n" + self.data_parallel_table()
            elif c.memory:
                text += "\n\n" + budget.format_memory(c.memory)
            text += "\n\n" + budget.format_communication(self.communication(), c.microbatches,
                                                          self.data_parallel().get("measured_comm"))
            text += "\n\n" + format_kernel_rows(self.kernels())
        return text + "\n\n" + self.activation_table()

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
            "activations": self.activations(),
            **({"plan": self.compiled.plan.to_dict(), "cuts": [list(c) for c in self.compiled.cuts],
                "stages": self.stages, "predicted": predicted_step(self.compiled),
                "collectives": self.collectives(), "data_parallel": self.data_parallel(),
                "flops": budget.stage_flops(self.compiled), "communication": self.communication(),
                "kernels": self.kernels(), "context_parallel": cp_rows(self.compiled),  # [] without cp
                "tp_coverage": getattr(self.tp_coverage(), "to_dict", dict)()}  # {} without TP
               if self.compiled is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def inspect(program, *, module: str | None = None, depth: int | None = 3, graph: bool = False,
            picture: str | Path | None = None, file=None, quiet: bool = False) -> Report:
    """Print the module table of ``program`` (and its graph with ``graph=True``); return the :class:`Report`.

    ``program`` is a traced :class:`Program` or a compiled model (read through ``view()``, its typed
    :class:`~fxpar.ir.rank_view.RankView`, or that record itself); for the latter the report adds the
    stage table (modules, params, predicted times, boundary tensors and bytes, predicted bubble) and
    ``report.stage_graph(i)`` reads any stage's graph.

    ``module`` restricts the table and graph to one module's subtree; ``depth`` how many module levels
    below it the table shows (None: all); ``picture`` writes a DOT file (and SVG where graphviz is
    installed) with one cluster per module.
    """
    compiled = None
    if isinstance(program, RankView) or (not isinstance(program, Program) and hasattr(program, "view")):
        compiled = view_of(program)  # a compiled or priced model, as the typed record it gives
        program = compiled.program
    if not isinstance(program, Program):
        raise TypeError(f"fxpar.inspect takes a traced Program (fxpar.trace) or a compiled model (fxpar.compile), "
                        f"got {type(program).__name__}")
    if not any(meta.COST in n.meta for n in program.graph.nodes):
        raise ValueError("the program has no cost metadata; trace it with fxpar.trace")
    rows = module_rows(program)
    if module and module not in rows:
        raise KeyError(f"module {module!r} owns no node or parameter; top-level modules: "
                       f"{sorted(r for r in rows if r and '.' not in r)}")
    report = Report(program, rows, depth, module, compiled=compiled)
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
