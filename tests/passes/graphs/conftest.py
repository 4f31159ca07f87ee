"""Before/after graph tests of the pass list, one file per pass (``test_<pass>.py``), TVM Relax style.

Each file builds a small input program (a tiny hand-written model traced by fxpar's frontend; the
expert-parallel file a one-layer zoo MoE), runs its pass through the pass runner and compares the
normalised printout of the graph after it with a golden text under ``golden/<pass>[-<case>].txt``.

The printout (:func:`graph_text`) keeps what a pass decides and nothing else: per node its name, op,
target, arguments (nodes by name, tensors by dtype and shape), the dtype and shape it produces, its
placement, and for attributes the tensor they hold (dtype, shape, device); submodules (recompute's
layers) follow their caller. No memory address, no timing, no source line.

Regenerate after an intended change of a pass's output, then read the diff before committing it::

    FXPAR_UPDATE_GOLDEN=1 .venv/bin/pytest tests/passes/graphs -q
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.ir import meta
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.stage import PipelineProgram
from fxpar.passes.runner import PassContext, Runner
from fxpar.report.graph import describe_val

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FXPAR_UPDATE_GOLDEN") == "1"
VOCAB, HIDDEN, BATCH, SEQ = 16, 8, 2, 4


class Block(torch.nn.Module):
    """A layer: one-head self-attention without projections (what recompute saves), then an MLP; an fp32
    upcast first (torch.export records a dtype assert for ``.to``)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        x = x.to(torch.float32)
        x = x + F.scaled_dot_product_attention(x, x, x, is_causal=True)
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(torch.nn.Module):
    """Embedding, positions from ``arange`` (a factory call), two blocks, an LM head and its loss."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos = torch.nn.Embedding(SEQ, HIDDEN)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def tiny_program(device: str = "cpu"):
    """:class:`TinyLM` (seed 0) traced by ``fxpar.trace`` on ``device`` ("meta": no weights)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.device(device):
            model = TinyLM()
    ids = torch.arange(BATCH * SEQ, device=device).reshape(BATCH, SEQ) % VOCAB
    return fxpar.trace(model, example_kwargs={"input_ids": ids, "labels": ids.flip(1)})


def context(plan: str, fields: dict | None = None, **kw) -> PassContext:
    """A pass context for rank 0 of ``plan`` with the plan ``fields`` a plan file would set (one pipeline
    stage unless ``cuts`` are given); nothing read from the environment (no disabled pass, no dump)."""
    plan = dataclasses.replace(fxpar.Plan.parse(plan), **(fields or {}))
    kw.setdefault("cuts", [])
    kw.setdefault("stage_to_rank", list(range(plan.pp)))
    return PassContext(plan, MeshSpec.for_plan(plan), disabled=frozenset(), dump_dir=None, **kw)


def split(program, ctx: PassContext) -> PipelineProgram:
    """``program`` through the pipeline split, the context set up as the pass list's ``run`` does."""
    from fxpar import passes

    ctx.program = program
    ctx.pipeline = Runner(ctx).run((passes.SPLIT,), program)
    return ctx.pipeline


def run_program_pass(name: str, program, ctx: PassContext):
    """(the printout of ``program``, ``program`` after the program pass ``name``, run under ``ctx``)."""
    from fxpar import passes

    p = next(p for p in passes.PROGRAM_PASSES if p.name == name)
    runner = Runner(ctx)
    assert runner.runs(p), f"the {name} pass does not run under {ctx.plan}"
    before = graph_text(program.gm)
    return before, runner.run([p], program)


def run_stage_pass(name: str, program, ctx: PassContext, first: tuple[str, ...] = ()):
    """(the printout of stage 0 of ``program`` after the split and the stage passes ``first``, that stage
    after the stage pass ``name``, run under ``ctx``)."""
    from fxpar import passes

    stage_passes = {p.name: p for p in passes.STAGE_PASSES}
    split(program, ctx)
    runner = Runner(ctx)
    runner.run_stages([stage_passes[n] for n in first], ctx.my_stages)
    assert runner.runs(stage_passes[name]), f"the {name} pass does not run under {ctx.plan}"
    before = graph_text(ctx.my_stages[0].gm)
    runner.run_stages([stage_passes[name]], ctx.my_stages)
    return before, ctx.my_stages[0]


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, torch.Tensor):
        return f"tensor({describe_val(a)})"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(map(_arg, a))
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if isinstance(a, float):
        return repr(a)
    return str(a)


def _target(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None) or str(t)
    return f"{getattr(t, '__module__', '') or ''}.{name}".lstrip(".").replace("torch._ops.", "")


def graph_text(gm: torch.fx.GraphModule, indent: str = "") -> str:
    """The normalised printout of ``gm`` (the module docstring says what it keeps)."""
    lines, subs = [], []
    for n in gm.graph.nodes:
        line = f"{indent}%{n.name} = {n.op} {_target(n)}"
        if n.op != "placeholder" and n.op != "get_attr":
            line += "(" + ", ".join([_arg(a) for a in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]) + ")"
        if n.op == "get_attr":
            held = gm
            for part in n.target.split("."):
                held = getattr(held, part, None)
            if isinstance(held, torch.Tensor):
                line += f" : {describe_val(held)} on {held.device.type}"
        elif n.op != "output" and describe_val(n.meta.get(meta.VAL)):
            line += f" -> {describe_val(n.meta[meta.VAL])}"
        if meta.PLACEMENT in n.meta:
            line += f"  @{n.meta[meta.PLACEMENT]}"
        lines.append(line)
        if n.op == "call_module":
            subs.append(n.target)
    for name in subs:
        sub = gm.get_submodule(name)
        body = next((m for m in sub.modules() if isinstance(m, torch.fx.GraphModule)), None)
        if body is not None:
            lines.append(f"{indent}{name} ({type(sub).__name__}):")
            lines.append(graph_text(body, indent + "  "))
    return "\n".join(lines)


@pytest.fixture
def kit():
    """This module: the tiny program, contexts and the printout, for the test files (which cannot import
    a conftest under ``--import-mode=importlib``)."""
    return sys.modules[__name__]


@pytest.fixture
def golden(request):
    """``golden(after, before=None, case="")``: compare the printouts (before the pass, where given, and
    after it) with ``golden/<pass>[-<case>].txt`` (the pass from the test file's name); with
    ``FXPAR_UPDATE_GOLDEN=1`` write that file instead."""

    def check(after: str, before: str | None = None, case: str = "") -> None:
        name = Path(request.node.fspath).stem.removeprefix("test_") + (f"-{case}" if case else "")
        text = after if before is None else f"# before\n{before}\n\n# after\n{after}"
        path = GOLDEN / f"{name}.txt"
        text = text.rstrip() + "\n"
        if UPDATE:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        assert path.exists(), f"no golden printout {path}: run with FXPAR_UPDATE_GOLDEN=1 and read it"
        assert text == path.read_text(), (f"the graph after the pass differs from {path} (if the change is "
                                          "intended: FXPAR_UPDATE_GOLDEN=1, then read the diff)")

    return check
