"""Context parallelism (``Plan(cp=N)``): every sequence split over the ``cp`` ranks, attention across them.

Reads: the traced program (every rank the same), the cp degree, this rank's cp coordinate and group name.
Writes: a new :class:`~fxpar.ir.program.Program` whose graph runs on this rank's chunks of each sequence.

**Layout.** A sequence of ``S`` tokens is cut into ``2N`` chunks of ``c = S / 2N``; rank ``r`` holds chunks
``r`` and ``2N - 1 - r`` (a head and a tail chunk, so each rank has the same causal attention work, as
torchtitan and Megatron balance it). A sharded value holds those ``2c`` rows of its sequence dim, head chunk
first.

**What is split, and where.** The batch reaches every cp rank whole (token ids, labels, positions and masks
are a few integers per token). Sharding starts at each embedding lookup of a user input's token ids: the
ids are cut to this rank's chunks there, and the sequence dim is then followed through the graph
(:mod:`fxpar.passes.cp_rules` says how each op moves it). A value computed from no sharded input (rotary
tables, masks, shifted labels: HF computes them from positions and ``arange``) stays whole and is cut to
this rank's rows where it meets a sharded one: locally, with no communication. So labels are shifted on the
whole sequence before they are cut (no token loses its target), rotary tables and masks are this rank's
rows of the model's own, and any mask kind the model builds (causal, sliding window, packed documents,
padding, bidirectional prefix) holds as it is.

**Attention.** Each attention (SDPA, or an eager ``q @ k^T`` / ``p @ v``) gets the keys and values of the
whole sequence by an all-gather over cp (``fxpar::all_gather_rs_bwd``: its backward reduce-scatters, each
rank's queries having read every key), put back in sequence order; the gather sits before any grouped-query
expansion (``repeat_kv``), so each KV head is sent once. Each rank then attends with its own query rows and
the mask's rows for them; ``is_causal`` becomes an explicit mask of this rank's positions.

**Loss.** A sum over the sequence (the loss's ``cross_entropy`` with ``sum``; ``mean`` becomes the sum over
this rank's tokens divided by the count over the whole sequence) is a per-rank partial: each rank's
backward starts from its own part, the loss returned is their all-reduced sum (whose backward is the
identity), and gradients sum over ``dp x cp`` in the data-parallel engine, as one process computes them. A
whole value added to a partial one counts ``1 / cp`` on each rank; a partial value an op needs whole is
all-reduced, its gradient all-reduced back.

**MoE.** A token-local MoE (the router's ``topk`` over the experts, the (token, k) pairs sorted by expert, the
rows picked in that order, grouped matmuls, the rows put back by the sort's inverse, ep's dispatch and combine
between) runs on this rank's tokens with no communication (:mod:`fxpar.passes.cp_tokens`); where a value in
this rank's own row order meets an op with no rule for it, the pass runs again with the sort (and the view
that flattened the rows) falling back, so the MoE runs on the whole sequence as before.

Any op without a rule gets its sharded inputs gathered (correct, and named in ``CpResult.gathered`` so
``fxpar inspect`` shows it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.program import Program, graph_module
from fxpar.passes import cp_rules as rules
from fxpar.passes import cp_ulysses
from fxpar.passes.cp_ops import outputs
from fxpar.passes.cp_rewriter import Rewriter
from fxpar.passes.local import refresh_vals

aten = torch.ops.aten


@dataclass
class CpResult:
    """What the pass did on one rank: for inspection and the tests."""

    cp: int = 1
    seq: int = 0  # the sequence length it split
    attention: list[str] = field(default_factory=list)  # attention nodes that now read gathered keys/values
    kv_gathers: list[str] = field(default_factory=list)  # the nodes whose value is gathered for attention
    gathered: list[str] = field(default_factory=list)  # nodes with no rule whose sharded inputs were gathered
    cut: list[str] = field(default_factory=list)  # whole values cut to this rank's rows
    attention_mode: str = "allgather"  # Plan.cp_attention
    ulysses: list[str] = field(default_factory=list)  # attention nodes that trade sequence for heads by all-to-all
    all_to_alls: list[str] = field(default_factory=list)  # their key/value roots sent by all-to-all
    kept: dict[str, str] = field(default_factory=dict)  # attention -> why it keeps the all-gather (ulysses, auto)
    token_local: list[str] = field(default_factory=list)  # nodes run on this rank's rows in its own order (MoE)


def sequence_length(program: Program) -> int:
    """The sequence length: dim 1 of the token ids that feed an embedding lookup."""
    for n in program.gm.graph.nodes:
        if n.op == "call_function" and rules.packet(n) is aten.embedding:
            ids = rules.user_input_of(n.args[1], program)
            if ids is not None:
                return int(ids.meta[meta.VAL].shape[1])
    raise PlanError("Plan(cp=...): fxpar/passes/context_parallel.py found no embedding lookup of token ids in "
                    "the model's graph, so it cannot tell which dim is the sequence; context parallelism needs "
                    "input_ids (or another user input) read by an embedding")


def check(program: Program, cp: int) -> None:
    """The sequence must cut into ``2 * cp`` equal chunks (PlanError before any rank communicates)."""
    s = sequence_length(program)
    if s % (2 * cp):
        fits = [k for k in range(2, s + 1) if s % (2 * k) == 0][:6]
        raise PlanError(f"Plan(cp={cp}): the sequence of {s} tokens does not cut into 2 x cp = {2 * cp} equal "
                        f"chunks (fxpar/passes/context_parallel.py balances causal attention with a head and a "
                        f"tail chunk per rank); pad the sequence to a multiple of {2 * cp}, or use cp in "
                        f"{fits or [1]}")


def _rewrite(program: Program, cp: int, rank: int, group: str, keep_outputs, attention: str,
             refused: frozenset | None):
    """One run of the rewrite on a copy of the traced graph; the token-local ops named in ``refused`` fall
    back (None: every one). Returns the graph, the result and the ops whose token-local values met a reader
    with no rule."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(program.gm.graph, {})  # the traced program is left as it was
    graph.output(out)
    gm = graph_module(program.gm, graph)
    seq = sequence_length(program)
    layout = rules.Layout(seq=seq, cp=cp, rank=rank, group=group)
    res = CpResult(cp=cp, seq=seq, attention_mode=attention)
    roots = rules.kv_roots(gm, program)  # analysis: where attention's keys and values are gathered
    uly = cp_ulysses.plan(gm, roots, cp, rules.token_fed(gm, program), attention) if attention != "allgather" \
        else None
    if uly is not None:
        cp_ulysses.mark(gm, uly)
        res.kept = dict(uly.kept)
    off = None if refused is None else frozenset(n for n in gm.graph.nodes if n.name in refused)
    rw = Rewriter(gm, program, layout, roots, res, uly, off)
    for node in list(gm.graph.nodes):
        if node.op == "call_function":
            rw.visit(node)
        elif node.op == "output":
            outputs(rw, node, keep_outputs)
    res.token_local = sorted({n.name for n, s in rw.state.items() if rules.is_local(s)})
    return gm, res, rw.broken


def context_parallel(program: Program, cp: int, rank: int, group: str, keep_outputs: set[int] | None = None,
                     attention: str = "allgather") -> tuple[Program, CpResult]:
    """``program`` rewritten for cp rank ``rank`` of ``cp`` in group ``group``. ``keep_outputs``: the user
    output positions returned whole (the loss); other sharded outputs stay this rank's rows (as TP leaves the
    logits vocabulary-sharded). ``attention``: ``Plan.cp_attention`` (``"ulysses"`` and ``"auto"``:
    :mod:`fxpar.passes.cp_ulysses`)."""
    check(program, cp)
    refused: frozenset = frozenset()
    try:
        while True:  # again while a token-local value met a reader with no rule for it, its sources refused
            gm, res, broken = _rewrite(program, cp, rank, group, keep_outputs, attention, refused)
            if not broken:
                break
            if not {n.name for n in broken} - refused:
                raise AssertionError(f"context_parallel: token-local ops {sorted(refused)} broken again")
            refused |= {n.name for n in broken}
    except PlanError:  # a fallback the token-local rules moved onto a buffer written in place: without them
        gm, res, _ = _rewrite(program, cp, rank, group, keep_outputs, attention, None)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    local = program.with_gm(gm)
    refresh_vals(local)
    return local, res
