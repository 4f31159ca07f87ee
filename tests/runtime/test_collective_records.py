"""A collective is its record (fxpar.ir.collectives): a record defined here alone, through the public
``fxpar.ir.ops.define`` and ``fxpar.runtime.collectives.register_kernel``, gives an op that traces with fake
tensors and runs forward and backward on 2 gloo ranks; expert parallelism's all-to-all records run by the
runtime's one all_to_all pattern, against the routing done by hand, with their byte counters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.ir import ops
from fxpar.ir.collectives import COLLECTIVES, PATTERNS, Collective
from fxpar.runtime import collectives
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool(2, shared=True)

# An all-reduce whose output's gradient is a per-rank partial (every rank's loss differs), so its backward
# is an all-reduce too: not an op of fxpar's, made of two existing patterns by this one record.
PARTIAL = Collective("test_all_reduce_partial_grad", ("all_reduce",), ("all_reduce",), "same", "all_reduce",
                     schema='Tensor x, str group, str op="sum"', kernel="all_reduce", grad="all_reduce",
                     reduce_arg=2, counted=False, doc="all-reduce, backward all-reduce (a test's record)")


def _partial():
    """The op of :data:`PARTIAL`, defined and given its kernel once per process."""
    if PARTIAL.name not in ops.OPS:
        ops.define(PARTIAL)
        collectives.register_kernel(PARTIAL)
    return ops.OPS[PARTIAL.name]


def test_every_pattern_and_gradient_is_implemented():
    assert set(collectives.PATTERN_KERNELS) == set(PATTERNS)
    assert all(r.grad is None or r.grad in COLLECTIVES for r in COLLECTIVES.values())
    assert set(ops.OPS) >= set(COLLECTIVES)


def test_every_expert_parallel_op_is_a_record():
    """ep_counts too (its kernel was registered by hand): an all-gather of the counts its prepare hook makes,
    shaped [ep, E] int64 by the record's fake kernel, its bytes under the record's counter."""
    from fxpar.ir import expert_ops

    assert all(getattr(expert_ops, name) is ops.OPS[name] for name in expert_ops.EP_OPS)
    rec = COLLECTIVES["ep_counts"]
    assert (rec.kernel, rec.forward, rec.counter, rec.counted) == ("all_gather", ("all_gather",), "counts", False)
    gm = make_fx(lambda offs: torch.ops.fxpar.ep_counts(offs, "ep:0,1", "moe"), tracing_mode="fake")(
        torch.tensor([2, 5, 5, 6], dtype=torch.int32))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert (tuple(out.meta["val"].shape), out.meta["val"].dtype) == ((2, 4), torch.int64)


def test_a_new_record_traces_with_fake_tensors():
    op = _partial()
    assert str(torch.ops.fxpar.test_all_reduce_partial_grad.default._schema) == (
        'fxpar::test_all_reduce_partial_grad(Tensor x, str group, str op="sum") -> Tensor')

    def fwd_bwd(x):
        return torch.autograd.grad(op(x, "tp:0,1", "avg").sum(), x)

    gm = make_fx(fwd_bwd, tracing_mode="fake")(torch.randn(2, 3, requires_grad=True))
    calls = [(n.target, n.args[1:]) for n in gm.graph.nodes if n.op == "call_function"
             and str(n.target).startswith("fxpar.")]
    assert calls == [(torch.ops.fxpar.test_all_reduce_partial_grad.default, ("tp:0,1", "avg")),
                     (torch.ops.fxpar.all_reduce.default, ("tp:0,1", "avg"))]
    with pytest.raises(Exception, match="unknown reduction 'mean'"):
        make_fx(lambda x: op(x, "tp:0,1", "mean"), tracing_mode="fake")(torch.randn(2))


class _Counters:
    def __init__(self):
        self.comm = {}


def _on_ranks():
    """On each of 2 ranks: the test record's forward and gradient, and an ep_dispatch -> ep_combine round
    trip (1 expert per rank, hidden 4, float64) with its gradient and the bytes counted."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(10 + r)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = _partial()(x, "world")
    (y * w).sum().backward()
    out = {"x": x.detach(), "w": w, "y": y.detach(), "grad": x.grad}

    counts = torch.tensor([[1, 2], [2, 1]])  # rank 0: 1 row for expert 0 (rank 0), 2 for expert 1; rank 1: 2, 1
    t = x.detach().clone().requires_grad_()
    collectives.Counting.active = counters = _Counters()
    try:
        sent = torch.ops.fxpar.ep_dispatch(t, counts, "world", "moe")
        back = torch.ops.fxpar.ep_combine(sent * 2, counts, "world", "moe")
        (back * w).sum().backward()
    finally:
        collectives.Counting.active = None
    out.update(dispatched=sent.detach(), back=back.detach(), ep_grad=t.grad, comm=counters.comm)
    return out


@pytest.mark.slow
def test_records_on_two_ranks(pool2):
    got = pool2.run(_on_ranks, timeout=60)
    xs, ws = [g["x"] for g in got], [g["w"] for g in got]
    for r, g in enumerate(got):
        torch.testing.assert_close(g["y"], xs[0] + xs[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(g["grad"], ws[0] + ws[1], rtol=0, atol=1e-12)
        # expert r's rows, grouped by expert, source rank within: rank 0 gets x0[0], x1[0], x1[1]
        mine = [xs[0][0:1], xs[1][0:2]] if r == 0 else [xs[0][1:3], xs[1][2:3]]
        want = torch.cat(mine + [torch.zeros(3, 4, dtype=torch.float64)])
        assert torch.equal(g["dispatched"], want)
        assert torch.equal(g["back"], 2 * xs[r]) and torch.equal(g["ep_grad"], 2 * ws[r])
        # each all-to-all sends 2 of its 3 rows off-rank: 2 rows x 4 x 8 bytes
        assert g["comm"] == {"dispatch": 64, "combine": 64, "dispatch_bwd": 64, "combine_bwd": 64}
