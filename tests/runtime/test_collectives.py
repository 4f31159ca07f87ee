"""fxpar's collective ops (fxpar.ir.ops; kernels in fxpar.runtime.collectives): identities and gradcheck
in one process, tracing with fake tensors (torch.export, make_fx) and graph accounting, then forward
values and gradients on 2 and 4 gloo ranks against the math done by hand, and a tensor-parallel (and
sequence-parallel) MLP against the unsharded one."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.cost.comm import collective_bytes, collective_ring_bytes, ring_bytes
from fxpar.ir import ops
from fxpar.ir.errors import CollectiveError, FxparError
from fxpar.runtime import collectives, groups
from fxpar.runtime.groups import (
    new_group,
    new_subgroups,
    register_group,
    registered_groups,
    resolve_group,
    unregister_group,
)
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)

# op name -> the arguments after the tensor, for a one-rank group
SINGLE_ARGS = {
    "all_reduce": ("tp",),
    "identity_fwd_all_reduce_bwd": ("tp",),
    "all_gather": ("tp", 1),
    "all_gather_rs_bwd": ("tp", -1),
    "reduce_scatter": ("tp", 0),
    "scatter_slice": ("tp", 1),
    "gather_params": ("tp", 0),
    "all_to_all": ("tp",),
}


@pytest.fixture
def clean_groups():
    before = dict(groups._GROUPS)
    yield
    groups._GROUPS.clear()
    groups._GROUPS.update(before)


# ---------------------------------------------------------------------------------------------------
# One process, no torch.distributed


@pytest.mark.parametrize("name", ops.COLLECTIVE_OPS)
def test_single_process_identity_and_gradcheck(name):
    assert not dist.is_initialized()
    op = getattr(ops, name)
    args = SINGLE_ARGS[name]
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = op(x, *args)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # a copy, never an alias
    assert getattr(torch.ops.fxpar, name).default(x, *args).shape == x.shape
    assert torch.autograd.gradcheck(lambda t: op(t, *args), (x,))
    assert torch.autograd.gradgradcheck(lambda t: op(t, *args), (x,))


def test_single_process_opcheck():
    """torch's own consistency checks: schema, fake kernel against the real one, autograd registration."""
    x = torch.randn(4, 6, requires_grad=True)
    for name in ops.COLLECTIVE_OPS:
        torch.library.opcheck(getattr(ops, name), (x, *SINGLE_ARGS[name]))


def test_all_reduce_reductions_single_process():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for op in ("avg", "max", "min"):
        assert torch.equal(ops.all_reduce(x, "world", op), x)
    assert torch.autograd.gradcheck(lambda t: ops.all_reduce(t, "world", "avg"), (x,))
    with pytest.raises(CollectiveError, match="no gradient"):
        ops.all_reduce(x, "world", "max").sum().backward()
    with pytest.raises(CollectiveError, match="unknown reduction 'prod'"):
        ops.all_reduce(x, "world", "prod")
    with pytest.raises(CollectiveError, match="'avg' needs a floating tensor"):
        ops.all_reduce(torch.ones(2, dtype=torch.int64), "world", "avg")


def test_group_registry_without_distributed(clean_groups):
    assert ops.group_size("world") == 1 and resolve_group("world") is None
    assert ops.group_size("tp") == 1 and resolve_group("tp") is None  # no dist: every group is one rank
    assert ops.group_size("tp:0,1,2") == 3  # the name lists the ranks
    register_group("dp", size=4)
    assert ops.group_size("dp") == 4 and registered_groups()["dp"] == 4
    x = torch.randn(8, 2)
    # a group with several ranks and no process group: fine for tracing, an error when run for real
    with pytest.raises(CollectiveError, match=r"fxpar\.all_reduce on group 'dp':.*size 4.*without a process group"):
        ops.all_reduce(x, "dp")
    with pytest.raises(CollectiveError, match=r"fxpar\.all_gather on group 'tp:0,1':.*2 ranks"):
        ops.all_gather(x, "tp:0,1", 0)
    register_group("one", size=1)
    assert torch.equal(ops.reduce_scatter(x, "one", 0), x)
    unregister_group("dp")
    assert ops.group_size("dp") == 1
    with pytest.raises(FxparError, match="non-empty string"):
        register_group("", size=1)


def test_local_shape_errors_name_op_group_and_sizes():
    x = torch.randn(6, 2)
    with pytest.raises(CollectiveError, match=r"fxpar\.all_gather on group 'tp': dim 2 is out of range.*\(6, 2\)"):
        ops.all_gather(x, "tp", 2)
    with FakeTensorMode():
        fx = torch.empty(6, 2)
        with pytest.raises(CollectiveError) as info:
            ops.reduce_scatter(fx, "tp:0,1,2,3", 0)
        assert ops.all_gather(torch.empty(2, 3), "tp:0,1,2,3", -1).shape == (2, 12)
    e = info.value
    assert (e.op, e.group, e.sizes) == ("reduce_scatter", "tp:0,1,2,3", [(6, 2)])
    assert "size 6" in str(e) and "4 equal shards" in str(e)
    with pytest.raises(CollectiveError, match=r"fxpar\.scatter_slice on group 'tp:0,1,2,3': dim 1 has size 2"):
        ops.scatter_slice(torch.empty(4, 2, device="meta"), "tp:0,1,2,3", 1)


# ---------------------------------------------------------------------------------------------------
# Fake tensors and graphs

G = "tp:0,1"  # a two-rank group known by its name alone: traceable in one process


class _TracedBlock(torch.nn.Module):
    """Megatron MLP with sequence-parallel input/output plus the plain tensor-parallel ops."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 4))  # this rank's half of a (16, 4) column-parallel weight
        self.w2 = torch.nn.Parameter(torch.randn(4, 8))  # this rank's half of a (4, 16) row-parallel weight

    def forward(self, x):  # x: (batch 2, seq 3 per rank, hidden 4)
        full = ops.all_gather_rs_bwd(x, G, 1)  # (2, 6, 4)
        h = torch.nn.functional.linear(ops.identity_fwd_all_reduce_bwd(full, G), self.w1).relu()
        out = ops.reduce_scatter(torch.nn.functional.linear(h, self.w2), G, 1)  # (2, 3, 4)
        rep = ops.all_reduce(torch.nn.functional.linear(h, self.w2), G)  # (2, 6, 4)
        gathered = ops.all_gather(out, G, -1)  # (2, 3, 8)
        return out, ops.scatter_slice(rep, G, 0), gathered  # scatter_slice -> (1, 6, 4)


def test_export_traces_ops_with_fake_shapes():
    ep = torch.export.export(_TracedBlock(), (torch.randn(2, 3, 4),))
    gm = ep.graph_module
    shapes = {}
    for node in gm.graph.nodes:
        kind = ops.collective_kind(node)
        if kind is not None:
            assert node.target is getattr(torch.ops.fxpar, kind).default
            assert node.args[1] == G
            shapes.setdefault(kind, []).append(tuple(node.meta["val"].shape))
    assert shapes == {
        "all_gather_rs_bwd": [(2, 6, 4)],
        "identity_fwd_all_reduce_bwd": [(2, 6, 4)],
        "reduce_scatter": [(2, 3, 4)],
        "all_reduce": [(2, 6, 4)],
        "all_gather": [(2, 3, 8)],
        "scatter_slice": [(1, 6, 4)],
    }
    assert ops.count_collectives(gm) == dict.fromkeys(ops.COLLECTIVE_OPS, 1) | {"gather_params": 0, "all_to_all": 0}

    # bytes: the full tensor each collective works on; float32 (2, 6, 4) = 192 bytes
    full = 2 * 6 * 4 * 4
    assert collective_bytes(gm) == {
        "all_reduce": full, "identity_fwd_all_reduce_bwd": 0, "all_gather": full,
        "all_gather_rs_bwd": full, "reduce_scatter": full, "scatter_slice": 0, "gather_params": 0, "all_to_all": 0,
    }
    assert collective_bytes(gm, backward=True) == {
        "all_reduce": 0, "identity_fwd_all_reduce_bwd": full, "all_gather": 0,
        "all_gather_rs_bwd": full, "reduce_scatter": full, "scatter_slice": full, "gather_params": 0, "all_to_all": 0,
    }
    # ring over 2 ranks: all-reduce sends 2 * 1/2 of the payload, gathers and scatters 1/2
    assert collective_ring_bytes(gm) == {
        "all_reduce": full, "identity_fwd_all_reduce_bwd": 0, "all_gather": full // 2,
        "all_gather_rs_bwd": full // 2, "reduce_scatter": full // 2, "scatter_slice": 0, "gather_params": 0,
        "all_to_all": 0,
    }
    assert ring_bytes("all_reduce", 1000, 4) == 1500 and ring_bytes("all_gather", 1000, 4) == 750
    assert ring_bytes("reduce_scatter", 1000, 1) == 0
    with pytest.raises(FxparError, match="unknown communication"):
        ring_bytes("gossip", 1, 2)


def test_make_fx_backward_shows_collectives():
    """A traced forward + backward holds the backward's collectives as fxpar nodes too."""
    block = _TracedBlock()

    def fwd_bwd(x, w1, w2):
        out, rep, gathered = torch.func.functional_call(block, {"w1": w1, "w2": w2}, (x,))
        loss = out.sum() + rep.sum() + gathered.sum()
        return torch.autograd.grad(loss, (x, w1, w2))

    args = (torch.randn(2, 3, 4, requires_grad=True), torch.randn(8, 4, requires_grad=True),
            torch.randn(4, 8, requires_grad=True))
    gm = make_fx(fwd_bwd, tracing_mode="fake")(*args)
    counts = ops.count_collectives(gm)
    # forward: one of each; backward: all_gather_rs_bwd -> reduce_scatter, identity_fwd -> all_reduce,
    # reduce_scatter -> all_gather, all_gather -> scatter_slice, scatter_slice -> all_gather
    assert counts == {"all_reduce": 2, "identity_fwd_all_reduce_bwd": 1, "all_gather": 3,
                      "all_gather_rs_bwd": 1, "reduce_scatter": 2, "scatter_slice": 2, "gather_params": 0,
                      "all_to_all": 0}
    grads = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert [tuple(g.meta["val"].shape) for g in grads] == [(2, 3, 4), (8, 4), (4, 8)]


def test_collective_bytes_needs_vals():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.fxpar.all_reduce.default, (x, "tp")))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert ops.count_collectives(gm)["all_reduce"] == 1
    with pytest.raises(FxparError, match="no meta\\['val'\\]"):
        collective_bytes(gm)


# ---------------------------------------------------------------------------------------------------
# Several gloo ranks: each op against the math done by hand

SHAPE = (2, 4, 3)


def _data(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _x(rank: int, shape=SHAPE):
    return _data(1000 + rank, shape)


def _w(rank: int, shape):
    return _data(2000 + rank, shape)


def _shard_shape(dim: int, n: int):
    s = list(SHAPE)
    s[dim] //= n
    return tuple(s)


def _full_shape(dim: int, n: int):
    s = list(SHAPE)
    s[dim] *= n
    return tuple(s)


def _cases(n: int):
    """(case name, op, extra args, input shape, output shape); dims 0, 1 and -1 on a (2, 4, 3) tensor."""
    cases = [("all_reduce", "sum", SHAPE, SHAPE), ("all_reduce", "avg", SHAPE, SHAPE),
             ("all_reduce", "max", SHAPE, SHAPE), ("identity_fwd_all_reduce_bwd", None, SHAPE, SHAPE)]
    for dim in (0, 1, -1):
        cases.append(("all_gather", dim, SHAPE, _full_shape(dim, n)))
        cases.append(("all_gather_rs_bwd", dim, SHAPE, _full_shape(dim, n)))
        if SHAPE[dim] % n == 0:
            cases.append(("reduce_scatter", dim, SHAPE, _shard_shape(dim, n)))
            cases.append(("scatter_slice", dim, SHAPE, _shard_shape(dim, n)))
    if SHAPE[0] % n == 0:  # one equal block of dim 0 per rank
        cases.append(("all_to_all", None, SHAPE, SHAPE))
    return cases


def _run_ops(label: str, groups, native_reduce_scatter: bool = False):
    """On one rank: run every case on this rank's group; return {case: (y, x.grad)}. Rank r's input is
    ``_x(r)`` (the same ``_x(0)`` everywhere for scatter_slice, which slices a replicated tensor) and its
    loss ``(y * _w(r)).sum()``; max has no gradient. ``native_reduce_scatter`` takes the NCCL code path
    of reduce_scatter (torch's single-tensor reduce-scatter, which recent gloo also has) instead of
    gloo's all-reduce + slice."""
    name = new_subgroups(label, groups) if groups else "world"
    n = ops.group_size(name)
    rank = dist.get_rank()
    out = {}
    backend_of = collectives._backend_of
    if native_reduce_scatter:
        collectives._backend_of = lambda pg, device: "native"
    try:
        for kind, extra, _, out_shape in _cases(n):
            x = (_x(0) if kind == "scatter_slice" else _x(rank)).requires_grad_()
            args = () if extra is None else (extra,)
            y = getattr(ops, kind)(x, name, *args)
            if extra != "max":
                (y * _w(rank, out_shape)).sum().backward()
            out[(kind, extra)] = (y.detach(), x.grad)
    finally:
        collectives._backend_of = backend_of
    return {"group": name, "size": n, "results": out}


def _narrow(t, dim, index, n):
    k = t.shape[dim] // n
    return t.narrow(dim, index * k, k)


def _expected(kind, extra, members, me, out_shape):
    """(y, grad) for group member ``members[me]`` (global ranks), by hand."""
    n = len(members)
    xs = [_x(r) for r in members]
    ws = [_w(r, out_shape) for r in members]
    wsum = sum(ws)
    if kind == "all_reduce":
        if extra == "max":
            return torch.stack(xs).amax(0), None
        y = sum(xs) / (n if extra == "avg" else 1)
        return y, ws[me] / (n if extra == "avg" else 1)
    if kind == "identity_fwd_all_reduce_bwd":
        return xs[me], wsum
    if kind == "all_gather":
        return torch.cat(xs, extra), _narrow(ws[me], extra, me, n)
    if kind == "all_gather_rs_bwd":
        return torch.cat(xs, extra), _narrow(wsum, extra, me, n)
    if kind == "reduce_scatter":
        return _narrow(sum(xs), extra, me, n), torch.cat(ws, extra)
    if kind == "scatter_slice":
        return _narrow(_x(0), extra, me, n), torch.cat(ws, extra)
    if kind == "all_to_all":  # block ``me`` of every rank's tensor, in rank order; the gradient the same way
        return torch.cat([_narrow(x, 0, me, n) for x in xs]), torch.cat([_narrow(w, 0, me, n) for w in ws])
    raise AssertionError(kind)


def _check_ops(pool, groups, native_reduce_scatter=False):
    world = pool.world_size
    per_rank = pool.run(_run_ops, "tp", groups, native_reduce_scatter, timeout=60)
    layout = groups or [list(range(world))]
    checked = 0
    for members in layout:
        n = len(members)
        for me, rank in enumerate(members):
            got = per_rank[rank]
            assert got["size"] == n
            assert got["group"] == ("world" if not groups else "tp:" + ",".join(map(str, members)))
            assert {k for k in got["results"]} == {(c[0], c[1]) for c in _cases(n)}
            for kind, extra, _, out_shape in _cases(n):
                y, grad = got["results"][(kind, extra)]
                want_y, want_grad = _expected(kind, extra, members, me, out_shape)
                where = f"{kind}({extra}) rank {rank} of {members}"
                assert y.shape == out_shape, where
                torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12, msg=where)
                if want_grad is not None:
                    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12, msg=where)
                checked += 1
    return checked


def test_ops_on_two_ranks(pool2):
    assert _check_ops(pool2, None) == 2 * len(_cases(2))


def test_ops_on_four_ranks(pool4):
    assert _check_ops(pool4, None) == 4 * len(_cases(4))


@pytest.mark.skipif(not hasattr(dist, "reduce_scatter_single"), reason="torch < 2.13: no gloo reduce_scatter_single")
def test_native_reduce_scatter_path(pool2, pool4):
    """The NCCL branch of reduce_scatter (dim moved to the front, single-tensor reduce-scatter) on gloo."""
    assert _check_ops(pool2, None, native_reduce_scatter=True) == 2 * len(_cases(2))
    assert _check_ops(pool4, [[0, 2], [1, 3]], native_reduce_scatter=True) == 4 * len(_cases(2))


def test_ops_on_four_ranks_two_groups(pool4):
    """Two tp groups of two: a rank's index in its group is not its global rank."""
    assert _check_ops(pool4, [[0, 1], [2, 3]]) == 4 * len(_cases(2))


def _mismatched_gather():
    register_group("tp", dist.group.WORLD)
    old = collectives.set_shape_checks(True)
    try:
        ops.all_gather(torch.zeros(2 + dist.get_rank(), 3), "tp", 0)
    except CollectiveError as e:
        return str(e), e.sizes
    finally:
        collectives.set_shape_checks(old)
    return None, None


def _not_divisible():
    register_group("tp", dist.group.WORLD)
    try:
        ops.reduce_scatter(torch.zeros(3, 5), "tp", 1)
    except CollectiveError as e:
        return str(e)


def _unknown_group():
    try:
        ops.all_reduce(torch.zeros(2), "nope")
    except FxparError as e:
        return str(e)


def _one_rank_never_comes():
    """Rank 0 all-reduces on a group whose peer never joins: it must give up after the group's timeout."""
    name = new_group("lonely", range(dist.get_world_size()), timeout=datetime.timedelta(seconds=1))
    if dist.get_rank() != 0:
        return None
    start = time.monotonic()
    try:
        ops.all_reduce(torch.ones(4), name)
    except CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_errors_on_ranks(pool2):
    for msg, sizes in pool2.run(_mismatched_gather, timeout=60):
        assert msg is not None and "fxpar.all_gather on group 'tp'" in msg
        assert "rank 0: (2, 3)" in msg and "rank 1: (3, 3)" in msg
        assert sizes == [(2, 3), (3, 3)]
    for msg in pool2.run(_not_divisible, timeout=60):
        assert "fxpar.reduce_scatter on group 'tp'" in msg and "size 5" in msg and "2 equal shards" in msg
    for msg in pool2.run(_unknown_group, timeout=60):
        assert "unknown process group 'nope'" in msg
    (msg, waited), none = pool2.run(_one_rank_never_comes, timeout=60)
    assert none is None
    assert "fxpar.all_reduce on group 'lonely'" in msg and "(4,)" in msg
    assert "Timed out waiting 1000ms" in msg  # gloo's own words, after the group's 1 s timeout
    assert waited < 10


# ---------------------------------------------------------------------------------------------------
# A Megatron MLP built from the ops equals the unsharded one

B, S, H, F = 2, 8, 6, 16


def _mlp_weights():
    return {k: _data(seed, shape) for k, seed, shape in
            (("w1", 1, (F, H)), ("b1", 2, (F,)), ("w2", 3, (H, F)), ("b2", 4, (H,)),
             ("x", 5, (B, S, H)), ("target", 6, (B, S, H)))}


def _mlp(x, w1, b1, w2, b2, reduce=None):
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    z = torch.nn.functional.linear(h, w2)
    return (reduce(z) if reduce else z) + b2


def _megatron_mlp(sequence_parallel: bool):
    """Tensor-parallel MLP on the whole world (column-parallel w1, row-parallel w2, both sliced from one
    seeded full weight); with ``sequence_parallel`` the input and output are split along the sequence.
    Returns the largest differences from the unsharded MLP, output and gradients."""
    register_group("tp", dist.group.WORLD)
    n, r = dist.get_world_size(), dist.get_rank()
    t = _mlp_weights()
    full = {k: t[k].clone().requires_grad_() for k in ("w1", "b1", "w2", "b2", "x")}
    ref = _mlp(full["x"], full["w1"], full["b1"], full["w2"], full["b2"])
    ((ref - t["target"]) ** 2).sum().backward()

    cols = slice(r * F // n, (r + 1) * F // n)
    w1 = t["w1"][cols].clone().requires_grad_()
    b1 = t["b1"][cols].clone().requires_grad_()
    w2 = t["w2"][:, cols].clone().requires_grad_()
    b2 = t["b2"].clone().requires_grad_()
    if sequence_parallel:
        x = _narrow(t["x"], 1, r, n).clone().requires_grad_()
        xin = ops.all_gather_rs_bwd(x, "tp", 1)
        y = _mlp(xin, w1, b1, w2, b2, reduce=lambda z: ops.reduce_scatter(z, "tp", 1))
        ((y - _narrow(t["target"], 1, r, n)) ** 2).sum().backward()  # the losses of all ranks add up
        want_y, want_x = _narrow(ref, 1, r, n), _narrow(full["x"].grad, 1, r, n)
        dist.all_reduce(b2.grad)  # a replicated parameter after a reduce-scatter: its gradient is partial
    else:
        x = t["x"].clone().requires_grad_()
        y = _mlp(ops.identity_fwd_all_reduce_bwd(x, "tp"), w1, b1, w2, b2,
                 reduce=lambda z: ops.all_reduce(z, "tp"))
        ((y - t["target"]) ** 2).sum().backward()  # every rank computes the same (replicated) loss
        want_y, want_x = ref, full["x"].grad
    diffs = {
        "y": (y - want_y).abs().max().item(),
        "x.grad": (x.grad - want_x).abs().max().item(),
        "w1.grad": (w1.grad - full["w1"].grad[cols]).abs().max().item(),
        "b1.grad": (b1.grad - full["b1"].grad[cols]).abs().max().item(),
        "w2.grad": (w2.grad - full["w2"].grad[:, cols]).abs().max().item(),
        "b2.grad": (b2.grad - full["b2"].grad).abs().max().item(),
    }
    return diffs


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_mlp_matches_unsharded(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for sequence_parallel in (False, True):
        for rank, diffs in enumerate(pool.run(_megatron_mlp, sequence_parallel, timeout=60)):
            bad = {k: v for k, v in diffs.items() if not v < 1e-10}
            assert not bad, f"world {world}, sequence_parallel={sequence_parallel}, rank {rank}: {bad}"
