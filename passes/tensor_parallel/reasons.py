"""Why the tensor-parallel pass leaves a parameter whole, and which cut parameters it gathers again.

Reads: the program's parameter table, the resolved styles, :func:`~.styles.param_dim`, this rank's
rewritten graph. Writes nothing: :func:`replicated_reasons` and :func:`gathered_params` fill
:attr:`~fxpar.ir.placement.TpResult.replicated` / ``gathered``, which ``fxpar inspect`` / ``fxpar plan``
show per module (:mod:`fxpar.report.tp_coverage`) and the compile path warns from.

A reason is ``"<kind>: <details>"``, the kind one of :data:`~fxpar.ir.placement.WHY_KINDS`, decided from
generic facts only (dims, whether a style reached the parameter, divisibility, size), never from names:

* ``norm/bias/scalar``: 0-D or 1-D (norm weights, a row-parallel layer's bias): replicated by design;
* ``replicated by plan``: the style says so (``replicate``, ``replicated_with_grad_allreduce``, ...);
* ``not divisible``: a style cuts it, but the dim (or a fused piece) is too small to give each of tp ranks
  a part (a dim tp does not divide is otherwise cut unevenly), or the style inference left its module
  out because its heads do not divide (``Styles.skipped``);
* ``layout not understood``: a style reached it but gives no dim for its shape;
* ``small``: no style, and at most 1/16 of the median size of the model's >= 2-D weights (a router gate);
* ``unused``: no node of the traced program reads it (an encoder-decoder's cross-attention traced
  without encoder states): nothing to cut by, and it costs no compute;
* ``no plan entry``: no style reached it.

A rule that keeps a parameter whole on purpose (one key/value head shared by all ranks) says why in
``Rewriter.why_whole[fqn]``; that reason wins over these.
"""

from __future__ import annotations

import statistics

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.placement import (
    WHY_BY_DESIGN,
    WHY_BY_PLAN,
    WHY_NO_PLAN,
    WHY_NOT_DIVISIBLE,
    WHY_NOT_UNDERSTOOD,
    WHY_SMALL,
    WHY_UNUSED,
    chunk_fits,
)
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.styles import param_dim

# marker styles that ask for a whole parameter (the others are markers on a module whose params have their own)
PLAN_REPLICATES = frozenset({"replicate", "replicated_with_grad_allreduce", "mla_kv_a_proj"})
SMALL_FRACTION = 16  # "small": numel * SMALL_FRACTION <= the median numel of the model's >= 2-D weights


def style_of(program: Program, fqn: str, styles: dict[str, str]) -> str | None:
    """The style that reaches parameter ``fqn`` (by any of its names, or its module's), as param_dim reads it."""
    style = None
    for name in program.params[fqn].fqns:
        style = styles.get(name) or styles.get(name.rpartition(".")[0]) or style
    return style


def small_below(program: Program) -> int:
    """Weights of at most this many elements are ``small``: 1/16 of the median >= 2-D parameter."""
    sizes = [p.numel for p in program.params.values() if not p.is_buffer and len(p.shape) >= 2]
    return int(statistics.median(sizes)) // SMALL_FRACTION if sizes else 0


def why_whole(program: Program, fqn: str, styles: dict[str, str], transposed: set[str],
              segments: dict[str, list[int]], tp: int, small: int) -> str:
    """The reason parameter ``fqn`` stays whole on every rank (see the module docstring)."""
    info = program.params[fqn]
    shape, nd = tuple(info.shape), len(info.shape)
    if nd <= 1:
        return f"{WHY_BY_DESIGN}: {nd}-D {shape}"
    style = style_of(program, fqn, styles)
    if style in PLAN_REPLICATES:
        return f"{WHY_BY_PLAN}: style {style!r}"
    if style is not None:
        try:  # the dim the style would cut, divisibility aside (every size divides by 1)
            d = param_dim(program, fqn, styles, transposed, segments, 1)
        except PlanError:
            d = None
        if d is None:
            return f"{WHY_NOT_UNDERSTOOD}: style {style!r} cuts no dim of a {nd}-D weight {shape}"
        bad = [s for s in segments.get(fqn, [shape[d]]) if not chunk_fits(s, tp)]  # uneven shares are cut
        if bad:
            unit = "rows" if d == 0 else "columns" if d == nd - 1 else "entries"
            what = f"fused pieces {segments[fqn]}" if fqn in segments else f"{shape[d]} {unit}"
            return f"{WHY_NOT_DIVISIBLE}: {what} along dim {d}, too few for a part on each of tp={tp} ranks"
        return f"{WHY_NOT_UNDERSTOOD}: style {style!r} on {shape} (dim {d}) left whole by the pass"
    # candidates the inference left whole: heads or features that do not divide
    skipped = getattr(styles, "skipped", {})
    why = next((skipped[m] for m in (n.rpartition(".")[0] for n in info.fqns) if m in skipped), None)
    if why is not None:
        return f"{WHY_NOT_DIVISIBLE}: {why}"
    if info.numel <= small:
        return f"{WHY_SMALL}: {info.numel} elements {shape} (<= {small}, 1/{SMALL_FRACTION} of the median weight)"
    return f"{WHY_NO_PLAN}: {shape}"


def replicated_reasons(program: Program, sharded: dict[str, int], styles: dict[str, str], transposed: set[str],
                       segments: dict[str, list[int]], tp: int, given: dict[str, str]) -> dict[str, str]:
    """Every parameter (not buffer) left whole -> why; ``given``: reasons rules recorded themselves."""
    small = small_below(program)
    read = {n.meta.get(meta.PARAM) for n in program.graph.nodes if n.op == "placeholder" and n.users}
    return {fqn: given.get(fqn) or (f"{WHY_UNUSED}: {tuple(info.shape)} not read by the traced program"
                                    if len(info.shape) >= 2 and fqn not in read
                                    else why_whole(program, fqn, styles, transposed, segments, tp, small))
            for fqn, info in program.params.items() if not info.is_buffer and fqn not in sharded}


def gathered_params(graph: torch.fx.Graph, sharded: dict[str, int]) -> dict[str, str]:
    """Cut parameters whose whole value is all-gathered where they are used (directly or through
    single-input ops such as a transpose) -> the op that needed it: memory saved, compute not."""
    out: dict[str, str] = {}
    gather = torch.ops.fxpar.all_gather.default
    for node in graph.nodes:
        if node.target is not gather:
            continue
        src, hops = node.args[0], 0
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and len(src.all_input_nodes) == 1 \
                and hops < 4:
            src, hops = src.all_input_nodes[0], hops + 1
        fqn = src.meta.get(meta.PARAM) if isinstance(src, torch.fx.Node) and src.op == "placeholder" else None
        if fqn in sharded and fqn not in out:
            users = [getattr(u.target, "__name__", str(u.target)) for u in node.users]
            out[fqn] = f"{WHY_NOT_UNDERSTOOD}: gathered whole for {', '.join(users) or '?'} " \
                       f"in {node.meta.get(meta.MODULE, '') or '(root)'}"
    return out
