"""Self-tests of fxpar.testing: the multi-rank pool, the LocalTensorMode helper and
the comparison helpers.

Rank functions are defined right here, at module level: the pool ships them by
reference and the workers load this file by path, which is what makes them work
under ``--import-mode=importlib``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from fxpar.testing import compare, local_tensor, multiproc

pool2 = multiproc.rank_pool_fixture(2, timeout=60)
pool4 = multiproc.rank_pool_fixture(4, timeout=60, failure_grace=1.0)


# --------------------------------------------------------------------------
# Rank functions (run inside the workers)
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Job:  # a test-module class, sent as an argument: the worker must load this module
    scale: float
    tag: str


def _identity():
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "module": __name__,
    }


def _all_reduce_sum(n: int):
    t = torch.arange(n, dtype=torch.float32) + 10.0 * dist.get_rank()
    dist.all_reduce(t)
    return t


def _scaled(x: torch.Tensor, *, job: Job, offset: float = 0.0):
    return job.tag, x * job.scale * dist.get_rank() + offset


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    t = torch.ones(2)
    dist.all_reduce(t)  # the other ranks block here until the pool kills them
    return t


def _exit_on_rank_one(how: str):
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    t = torch.ones(2)
    dist.all_reduce(t)
    return t


def _sleep_on_rank(rank: int, seconds: float):
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def _say_hello():
    print(f"hello from rank {dist.get_rank()}")
    return None


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _data_parallel_grads():
    """Each rank: its slice of the batch, local backward, all-reduce-average the grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Mlp()
    x, y = _data()
    per = x.shape[0] // world
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return compare.grads_by_fqn(model)


# --------------------------------------------------------------------------
# RankPool
# --------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_results_in_rank_order(world, pool2, pool4):
    pool = {2: pool2, 4: pool4}[world]
    out = pool.run(_identity)
    assert [o["rank"] for o in out] == list(range(world))
    assert all(o["world"] == world for o in out)
    assert len({o["pid"] for o in out}) == world
    assert all(o["threads"] == 1 and o["omp"] == "1" for o in out)
    # The worker loaded this very module (by name or by file) under the same name.
    assert all(o["module"] == __name__ for o in out)


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_sum(world, pool2, pool4):
    pool = {2: pool2, 4: pool4}[world]
    out = pool.run(_all_reduce_sum, 3)
    expected = world * torch.arange(3, dtype=torch.float32) + 10.0 * sum(range(world))
    for t in out:
        torch.testing.assert_close(t, expected)


def test_args_kwargs_and_test_module_classes(pool2):
    out = pool2.run(_scaled, torch.ones(2), job=Job(scale=2.0, tag="t"), offset=1.0)
    assert [o[0] for o in out] == ["t", "t"]
    torch.testing.assert_close(out[1][1], torch.full((2,), 3.0))


_UNIMPORTABLE = """
import dataclasses
import torch.distributed as dist


@dataclasses.dataclass
class Payload:
    value: int


def times_rank(p):
    return Payload(p.value * (dist.get_rank() + 1)), __name__
"""


def test_module_not_importable_by_name(pool2, tmp_path):
    """What pytest --import-mode=importlib does to test modules: registered in
    sys.modules under a dotted name that no sys.path entry can import."""
    import importlib.util
    import sys

    path = tmp_path / "rankmod.py"
    path.write_text(_UNIMPORTABLE)
    name = "fxpar_selftest_nowhere.rankmod"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        out = pool2.run(mod.times_rank, mod.Payload(5))
    finally:
        del sys.modules[name]
    assert [o[0].value for o in out] == [5, 10]
    assert all(o[1] == name for o in out)


def test_function_by_reference_string(pool2):
    out = pool2.run("fxpar.testing.multiproc:rank_info")
    assert [o["rank"] for o in out] == [0, 1]


def test_unpicklable_function_fails_in_parent(pool2):
    with pytest.raises(TypeError, match="module level"):
        pool2.run(lambda: 1)
    assert pool2.run(_all_reduce_sum, 1)[0].item() == 10.0  # pool untouched


def test_output_is_echoed(pool2, capsys):
    pool2.run(_say_hello)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out


def test_exception_names_rank_and_traceback(pool4):
    restarts = pool4.restarts
    t0 = time.monotonic()
    with pytest.raises(multiproc.RankFailure) as info:
        pool4.run(_raise_on_rank_one, timeout=10)
    elapsed = time.monotonic() - t0
    err = info.value
    assert not isinstance(err, multiproc.RankTimeout)
    assert err.ranks == [1]
    msg = str(err)
    assert "rank 1" in msg and "ValueError: deliberate failure on rank one" in msg
    assert "Traceback" in msg and "_raise_on_rank_one" in msg
    assert "ranks 0, 2, 3" in msg  # blocked in all_reduce, reported and killed
    assert "all_reduce" in msg  # their dumped stacks show where they were stuck
    assert elapsed < 10
    # The pool restarts transparently.
    out = pool4.run(_all_reduce_sum, 2)
    assert pool4.restarts == restarts + 1
    torch.testing.assert_close(out[3], torch.tensor([60.0, 64.0]))


@pytest.mark.parametrize("how,code", [("exit", 3), ("segv", -signal.SIGSEGV)])
def test_dead_rank_reports_exit_code(pool4, how, code):
    t0 = time.monotonic()
    with pytest.raises(multiproc.RankFailure) as info:
        pool4.run(_exit_on_rank_one, how, timeout=10)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.exit_codes == {1: code}
    assert f"exit code {code}" in str(err)
    assert "rank 1: died" in str(err)
    if how == "segv":
        assert "Fatal Python error" in str(err)  # faulthandler's report from the rank
    assert len(pool4.run(_identity)) == 4


def test_timeout_names_unanswered_ranks(pool4):
    t0 = time.monotonic()
    with pytest.raises(multiproc.RankTimeout) as info:
        pool4.run(_sleep_on_rank, 2, 60.0, timeout=2)
    assert time.monotonic() - t0 < 8
    err = info.value
    assert err.unanswered == [2]
    assert err.results[:2] == [0, 1] and err.results[2] is None
    assert "rank 2 of 4 had not answered" in str(err)
    assert "time.sleep" in str(err) or "_sleep_on_rank" in str(err)
    assert [o["rank"] for o in pool4.run(_identity)] == [0, 1, 2, 3]


def test_worker_killed_while_idle_is_replaced(pool2):
    victim = pool2.pids[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until it is really gone (and reaped)
        try:
            os.kill(victim, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    out = pool2.run(_identity)
    assert [o["rank"] for o in out] == [0, 1] and out[1]["pid"] != victim


def test_shared_pool_is_reused():
    pool = multiproc.shared_rank_pool(2, timeout=30)
    assert multiproc.shared_rank_pool(2, timeout=30) is pool
    assert [o["rank"] for o in pool.run(_identity)] == [0, 1]
    pool.close()
    assert multiproc.shared_rank_pool(2, timeout=30) is not pool  # a closed one is replaced


def test_restart_and_close_leave_no_processes():
    pool = multiproc.RankPool(2, timeout=30)
    first = pool.start().pids
    pool.restart()
    second = pool.pids
    assert pool.restarts == 1 and not set(first) & set(second)
    pool.close()
    for pid in first + second:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_identity)


def test_run_on_ranks_one_shot():
    out = multiproc.run_on_ranks(2, _all_reduce_sum, 2, timeout=30)
    torch.testing.assert_close(out[0], torch.tensor([10.0, 12.0]))


@pytest.mark.slow
def test_world_8():
    with multiproc.RankPool(8, timeout=60) as pool:
        out = pool.run(_all_reduce_sum, 2)
        assert [o["rank"] for o in pool.run(_identity)] == list(range(8))
    torch.testing.assert_close(out[7], torch.tensor([280.0, 288.0]))


def test_data_parallel_grads_match_reference(pool2):
    x, y = _data()
    loss, expected = compare.reference_step(
        _Mlp, x, loss_fn=lambda out, inp: torch.nn.functional.mse_loss(out, y)
    )
    assert loss.ndim == 0
    grads = pool2.run(_data_parallel_grads)
    for g in grads:
        compare.assert_grads_close(g, expected, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------
# LocalTensorMode helper
# --------------------------------------------------------------------------


def _spmd_all_reduce():
    x = local_tensor.per_rank_tensor(lambda r: torch.full((2,), float(r + 1)))
    y = x.clone()
    dist.all_reduce(y)
    return {"x": x, "sum": y, "rank": local_tensor.current_rank(), "const": 7}


def test_local_tensor_all_reduce():
    out = local_tensor.run_spmd(4, _spmd_all_reduce)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    for r, o in enumerate(out):
        torch.testing.assert_close(o["x"], torch.full((2,), float(r + 1)))
        torch.testing.assert_close(o["sum"], torch.full((2,), 10.0))
        assert o["const"] == 7
    assert not dist.is_initialized()  # the fake group is gone


def _spmd_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    # torch.manual_seed is per simulated rank (same stream on each); an explicit
    # torch.Generator would be shared and give each rank different numbers.
    torch.manual_seed(0)
    w, x = torch.randn(4, 3), torch.randn(5, 3)
    dw = distribute_tensor(w, mesh, [Shard(0)])
    dx = distribute_tensor(x, mesh, [Replicate()])
    dy = dx @ dw.t()  # sharded on columns
    return dy, dy.full_tensor(), x @ w.t()


def _spmd_generator_draws():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, generator=g)


def test_local_tensor_dtensor():
    out = local_tensor.run_spmd(2, _spmd_dtensor)
    full_ref = out[0][2]
    for r, (shard, full, ref) in enumerate(out):
        assert shard.shape == (5, 2)
        torch.testing.assert_close(shard, full_ref[:, 2 * r : 2 * r + 2])
        torch.testing.assert_close(full, ref)


def test_local_tensor_explicit_generator_caveat():
    a, b = local_tensor.run_spmd(2, _spmd_generator_draws)
    assert not torch.equal(a, b)  # documented caveat: a shared generator advances per rank


def test_simulated_ranks_refuses_foreign_group_size():
    with local_tensor.simulated_ranks(2):
        with pytest.raises(RuntimeError, match="fake"):
            with local_tensor.simulated_ranks(4):
                pass
    assert not dist.is_initialized()


def test_compare_local_tensors_and_dtensors_under_simulation():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(8.0).reshape(4, 2)
    with local_tensor.simulated_ranks(2):
        x = local_tensor.per_rank_tensor([torch.zeros(2), torch.tensor([0.0, 1.0])])
        with pytest.raises(AssertionError, match=r"rank 1\)"):
            compare.assert_close_tree({"y": x}, {"y": torch.zeros(2)}, atol=1e-6, rtol=0)
        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(full, mesh, [Shard(0)])
        compare.assert_close_tree(d, full)  # gathered with full_tensor(), then per rank
        with pytest.raises(AssertionError, match="max abs diff 1"):
            compare.assert_close_tree(d + 1, full)


# --------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------


def test_assert_close_tree_passes_and_names_first_mismatch():
    a = {"logits": torch.zeros(2, 3), "aux": (torch.ones(2), [1, "x"])}
    compare.assert_close_tree(a, {"logits": torch.zeros(2, 3), "aux": (torch.ones(2), [1, "x"])})
    b = {"logits": torch.zeros(2, 3), "aux": (torch.ones(2), [1, "x"])}
    b["logits"][1, 2] = 0.5
    with pytest.raises(AssertionError) as info:
        compare.assert_close_tree(a, b, atol=1e-4, rtol=1e-4, what="out")
    msg = str(info.value)
    assert "out['logits']" in msg and "0.5" in msg and "(1, 2)" in msg
    with pytest.raises(AssertionError, match=r"out\['aux'\]\[1\]: length"):
        compare.assert_close_tree(a, {"logits": torch.zeros(2, 3), "aux": (torch.ones(2), [1])}, what="out")
    with pytest.raises(AssertionError, match="shape"):
        compare.assert_close_tree(torch.zeros(2), torch.zeros(3))


def test_assert_close_tree_model_output_and_max_diff():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    a = CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.zeros(1, 2, 4))
    b = CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.zeros(1, 2, 4) + 1e-3)
    with pytest.raises(AssertionError, match=r"outputs\['logits'\]"):
        compare.assert_close_tree(a, b, atol=1e-5, rtol=0)
    compare.assert_close_tree(a, b, atol=1e-2, rtol=0)
    assert compare.max_abs_diff_tree(a, b) == pytest.approx(1e-3, rel=1e-3)
    assert compare.max_abs_diff_tree((torch.zeros(2),), (torch.zeros(3),)) == float("inf")
    with pytest.raises(ValueError, match="structures differ"):
        compare.max_abs_diff_tree({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    return GPT2LMHeadModel(cfg)


def test_reference_step_hf_and_perturbed_grad_is_named():
    ids = torch.tensor([[1, 2, 3, 4]])
    inputs = {"input_ids": ids, "labels": ids}
    loss, grads = compare.reference_step(_tiny_gpt2, inputs)
    loss2, grads2 = compare.reference_step(_tiny_gpt2, inputs)
    assert torch.isfinite(loss) and loss == loss2
    compare.assert_grads_close(grads2, grads)
    assert "transformer.h.0.attn.c_attn.weight" in grads

    bad = dict(grads2)
    bad["transformer.h.0.mlp.c_fc.bias"] = bad["transformer.h.0.mlp.c_fc.bias"] + 0.25
    del bad["transformer.wpe.weight"]
    with pytest.raises(AssertionError) as info:
        compare.assert_grads_close(bad, grads, atol=1e-6, rtol=1e-6)
    msg = str(info.value)
    assert "transformer.h.0.mlp.c_fc.bias" in msg and "0.25" in msg
    assert "missing from actual" in msg
    # Unperturbed parameters are not listed.
    assert "transformer.h.0.attn.c_attn.weight" not in msg
