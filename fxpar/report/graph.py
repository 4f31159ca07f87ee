"""Readable graph printouts and DOT/SVG pictures with one cluster per module.

Reads ``val``, ``fxpar.module``, ``fxpar.param`` and ``fxpar.cost``. A printout line reads (one line, shown
here in two)::

    %linear = aten.linear(%mul_3, %model.layers.0.self_attn.q_proj.weight) -> f32[2, 8, 64]
        # model.layers.0.self_attn.q_proj  16.38K FLOPs

Parameters are shown by FQN, not by placeholder name.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpar.ir import meta
from fxpar.ir.program import Program, iter_nodes
from fxpar.report.table import human

_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.int8: "i8", torch.uint8: "u8"}


def describe_val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_DTYPE.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(describe_val(x) for x in v) + ")"
    return "" if v is None else type(v).__name__


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        name = t.name().replace("::", ".")
        return name[:-len(".default")] if name.endswith(".default") else name
    return getattr(t, "__name__", str(t))


def _ref(node: torch.fx.Node) -> str:
    fqn = node.meta.get(meta.PARAM)
    return f"%{fqn}" if fqn else f"%{node.name}"


def _fmt_arg(a) -> str:
    def one(x):
        return _ref(x) if isinstance(x, torch.fx.Node) else repr(x)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return one(a)


def placement_text(placements) -> str:
    """DTensor notation: ``Shard(2)``, ``Replicate()``, ``Partial()`` (one per mesh axis)."""
    def one(p):
        return f"Shard({p.dim})" if hasattr(p, "dim") else f"{type(p).__name__}()"
    return ", ".join(one(p) for p in placements)


def node_line(node: torch.fx.Node) -> str:
    val = describe_val(node.meta.get(meta.VAL))
    if meta.PLACEMENT in node.meta:
        val += " " + placement_text(node.meta[meta.PLACEMENT])
    owner = node.meta.get(meta.MODULE, "")
    cost = node.meta.get(meta.COST, meta.ZERO_COST)
    tail = f"  # {owner or '<root>'}" + (f"  {human(cost.flops)} FLOPs" if cost.flops else "")
    if node.op == "placeholder":
        kind = "param" if node.meta.get(meta.PARAM) else "input"
        return f"{_ref(node)} = {kind} -> {val}{tail}"
    if node.op == "output":
        return "return " + _fmt_arg(pytree.tree_leaves(node.args))
    if node.op == "get_attr":
        return f"%{node.name} = get_attr {node.target}"
    args = ", ".join([_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()])
    return f"%{node.name} = {_op_name(node)}({args}) -> {val}{tail}"


def in_module(node: torch.fx.Node, module: str | None) -> bool:
    if not module:
        return True
    owner = node.meta.get(meta.MODULE, "")
    return owner == module or owner.startswith(module + ".")


def graph_text(program: Program, module: str | None = None) -> str:
    """The graph (or the part owned by ``module`` and its submodules), one node a line."""
    known = {m for n in program.nodes() for m in [n.meta.get(meta.MODULE, "")]}
    if module and not any(k == module or k.startswith(module + ".") for k in known):
        close = sorted(k for k in known if module.rpartition(".")[0] and k.startswith(module.rpartition(".")[0]))
        raise KeyError(f"no graph node belongs to module {module!r}; modules near it: {close[:10]}")
    lines = []
    for node in iter_nodes(program.gm):
        if node.op in ("placeholder", "output") and module:
            if node.op == "placeholder" and node.meta.get(meta.PARAM) and in_module(node, module):
                lines.append(node_line(node))
            continue
        if in_module(node, module):
            lines.append(node_line(node))
    return "\n".join(lines)


def module_text(gm: torch.fx.GraphModule) -> str:
    """Every node of a GraphModule (a pipeline stage, say), one a line; get_attr parameters by FQN."""
    lines = []
    for node in iter_nodes(gm):
        if node.op == "get_attr" and meta.PARAM not in node.meta and "." in str(node.target):
            lines.append(f"%{node.target} = param -> {describe_val(node.meta.get(meta.VAL))}")
        else:
            lines.append(node_line(node))
    return "\n".join(lines)


def _dot_id(name: str) -> str:
    return '"' + name.replace('"', r"\"") + '"'


def to_dot(program: Program, module: str | None = None, *, max_depth: int | None = None) -> str:
    """DOT text: one nested cluster per module (down to ``max_depth`` levels), nodes in their module."""
    nodes = [n for n in iter_nodes(program.gm, recurse=False)
             if n.op not in ("output", "get_attr") and in_module(n, module)]
    tree: dict = {}
    for n in nodes:
        owner = n.meta.get(meta.MODULE, "")
        parts = owner.split(".") if owner else []
        if max_depth is not None:
            parts = parts[:max_depth]
        t = tree
        for p in parts:
            t = t.setdefault(p, {})
        t.setdefault(None, []).append(n)

    lines = ["digraph fxpar {", "  rankdir=TB;", '  node [shape=box, fontsize=9, fontname="monospace"];']
    counter = [0]

    def emit(t: dict, path: list[str], indent: str):
        for n in t.get(None, []):
            label = f"{n.meta.get(meta.PARAM) or n.name}\\n{_op_name(n) if n.op == 'call_function' else n.op}" \
                    f"\\n{describe_val(n.meta.get(meta.VAL))}"
            style = ', style=filled, fillcolor="#fde9c9"' if n.meta.get(meta.PARAM) else ""
            lines.append(f"{indent}{_dot_id(n.name)} [label={_dot_id(label)}{style}];")
        for key, sub in t.items():
            if key is None:
                continue
            counter[0] += 1
            name = ".".join(path + [key])
            lines.append(f"{indent}subgraph cluster_{counter[0]} {{")
            lines.append(f"{indent}  label={_dot_id(name)}; style=rounded; color=gray50;")
            emit(sub, path + [key], indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, [], "  ")
    shown = {n.name for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name in shown:
                lines.append(f"  {_dot_id(a.name)} -> {_dot_id(n.name)};")
    lines.append("}")
    return "\n".join(lines)


def partition_dot(stages: list[dict], collectives: list[dict], title: str) -> str:
    """DOT of a partitioned program: one cluster per pipeline stage (its rank, parameters, predicted
    times), one box per layer inside it with that layer's tensor-parallel collectives, and an edge per
    stage boundary with the bytes it carries."""
    per_layer = {r["layer"]: r for r in collectives}
    lines = ["digraph partition {", "  rankdir=LR;", '  node [shape=box, fontsize=9, fontname="monospace"];',
             f"  label={_dot_id(title)}; labelloc=t;"]
    for st in stages:
        i = st["stage"]
        lines.append(f"  subgraph cluster_stage{i} {{")
        label = f"stage {i} on pp rank {st['pp_rank']}: {human(st['params'])} params"
        lines.append(f"    label={_dot_id(label)}; style=filled; color=\"#e8eef8\";")
        layers: list[str] = []
        for m in st["modules"] or [st["from"]]:
            layer = m if m in per_layer else next((k for k in per_layer if m.startswith(k + ".")), m)
            if layer not in layers:
                layers.append(layer)
        for j, layer in enumerate(layers):
            r = per_layer.get(layer)
            comm = "" if r is None else "\\n" + ", ".join(f"{n} {k}" for k, n in sorted(r["forward"].items()))
            lines.append(f"    s{i}_{j} [label={_dot_id(layer + comm)}];")
        lines.append(f"    s{i}_in [shape=point]; s{i}_in -> s{i}_0 [style=invis];")
        lines.append("  }")
    for st in stages[:-1]:
        i = st["stage"]
        lines.append(f"  s{i}_in -> s{i + 1}_in [label={_dot_id(human(st['send_bytes'], 'B'))}, style=bold];")
    lines.append("}")
    return "\n".join(lines)


def write_dot(text: str, path: str | Path) -> list[Path]:
    """Write DOT text to ``path`` (.dot) and, when graphviz's ``dot`` is installed, the .svg beside it."""
    path = Path(path)
    if path.suffix != ".dot":
        path = path.with_suffix(".dot")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    written = [path]
    dot = shutil.which("dot")
    if dot:
        svg = path.with_suffix(".svg")
        subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True, timeout=300)
        written.append(svg)
    return written


def write_picture(program: Program, path: str | Path, module: str | None = None, *,
                  max_depth: int | None = None) -> list[Path]:
    """Write ``path`` (.dot) and, when graphviz's ``dot`` is installed, the .svg beside it."""
    return write_dot(to_dot(program, module, max_depth=max_depth), path)
