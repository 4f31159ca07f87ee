"""What a data-parallel step costs beyond the model's own work, on gloo: DDP's gradient buckets (filled as
gradients become final, reduced during backward, reused from step to step, the parameters' gradients
left as views of them), the per-program learning of when a gradient is final, and ZeRO-3 keeping the
last gathered bucket for the backward that follows. Numbers against one process throughout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar import zoo
from fxpar.runtime.data_parallel import DataParallelEngine
from fxpar.runtime.zero3 import Zero3Regather
from fxpar.testing import multiproc
from fxpar.testing.reference import reference_step

TOL = 1e-5
pool2 = multiproc.rank_pool(2)


def _frozen(params):
    return torch.optim.SGD(params, lr=0.0)  # weights kept: every step's gradients are the reference's


def _worst(grads: dict, ref: dict) -> float:
    assert set(grads) == set(ref), (sorted(grads), sorted(ref))
    return max((grads[k] - ref[k]).abs().max().item() for k in ref)


def test_first_bucket_is_small_as_torch_ddp():
    """Backward's first gradients (the last parameters) go in a bucket of at most 1 MiB, the rest up to
    bucket_bytes, in reverse parameter order, each parameter once."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])  # 257 KiB per layer
    named = list(model.named_parameters())
    engine = DataParallelEngine(named, _frozen, dp=2, rank=0, zero=0, bucket_bytes=2**21)
    sizes = [sum(p.numel() * 4 for p in b.params) for b in engine.buckets]
    assert sizes[0] <= 2**20 < sizes[0] + 256 * 256 * 4 and all(s <= 2**21 for s in sizes[1:]), sizes
    order = [n for b in engine.buckets for n in b.names]
    assert order == [n for n, _ in reversed(named)]
    engine.close()


def _ddp_steps(name: str) -> dict:
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=4, seq=8)
    compiled = fxpar.compile(zoo.build(name, seed=0), fxpar.Plan(dp=2, bucket_mb=0.02), example_kwargs=batch,
                             optimizer=_frozen, timeout=60)
    engine = compiled.engine
    launched = []
    finish = engine.finish

    def spy():
        launched.append([b.work is not None for b in engine.buckets])  # reductions issued during backward
        finish()
    engine.finish = spy
    ref_loss, ref = reference_step(lambda: zoo.build(name, seed=0), batch)
    out = {"loss": 0.0, "grads": 0.0, "launched": launched, "buckets": len(engine.buckets)}
    ptrs = []
    for _ in range(3):
        out["loss"] = max(out["loss"], abs(compiled.step(**batch).item() - ref_loss.item()))
        ptrs.append([b.flat.data_ptr() for b in engine.buckets])
        out["views"] = all(p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
                           for b in engine.buckets for p in b.params)
        out["grads"] = max(out["grads"], _worst(compiled.full_state_dict(grads=True), ref))
    out["reused"] = ptrs[0] == ptrs[1] == ptrs[2]
    return out


def test_ddp_buckets_reduce_during_backward_reused_as_gradient_views(pool2):
    for r in pool2.run(_ddp_steps, "llama", timeout=120):
        assert r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["buckets"] > 2 and r["views"] and r["reused"], r
        assert r["launched"] == [[False] * r["buckets"]] + [[True] * r["buckets"]] * 2  # learned on step 1


def _late_gradient() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = DataParallelEngine(list(model.named_parameters()), _frozen, dp=2, rank=dist.get_rank(), zero=0,
                                group="world")
    x = torch.randn(3, 4) * (dist.get_rank() + 1)

    def step(key, passes: int):
        for p in model.parameters():
            p.grad = None
        engine.start_step(key)
        for _ in range(passes):
            model(x).sum().backward()
        engine.finish()

    step("two", 2)  # learns: two gradients per parameter per step of program "two"
    step("two", 2)  # the bucket goes at the second, during backward
    got = model.weight.grad.clone()
    want = x.sum(0).expand(3, 4) * 2  # d(sum(Wx + b))/dW summed over two passes ...
    both = want.clone()
    dist.all_reduce(both)  # ... and over the two ranks
    step("three", 3)  # another program learns its own count
    three = model.weight.grad.clone()
    try:
        step("two", 3)
        error = ""
    except RuntimeError as e:
        error = str(e)
    engine.close()
    return {"two": (got - both).abs().max().item(), "three": (three - both * 1.5).abs().max().item(),
            "error": error}


def test_late_gradient_fails_loudly_and_counts_are_learned_per_program(pool2):
    for r in pool2.run(_late_gradient, timeout=60):
        assert r["two"] <= 1e-6 and r["three"] <= 1e-6, r
        assert "got [3, 3] gradients this step, more than the [2, 2] learned" in r["error"], r["error"]


def _zero3_keeps_last() -> dict:
    from torch.profiler import ProfilerActivity, profile

    name = "llama"
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=4, seq=8)
    compiled = fxpar.compile(zoo.build(name, seed=0), fxpar.Plan(dp=2, zero=3), example_kwargs=batch,
                             optimizer=_frozen, timeout=60)
    (_, runtime, _), = compiled.programs.entries.values()
    ref_loss, ref = reference_step(lambda: zoo.build(name, seed=0), batch)
    out = {}
    for key, context in (("kept", runtime.forward_context),
                         ("regathered", lambda backward_next: Zero3Regather(backward_next=False))):
        runtime.forward_context = context
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = compiled.step(**batch).item()
        gathers = sum(e.count for e in prof.key_averages() if "allgather" in e.key.lower())
        grads = compiled.full_state_dict(grads=True)
        out[key] = {"gathers": gathers, "loss": loss, "grads": grads, "ref": _worst(grads, ref),
                    "ref_loss": abs(loss - ref_loss.item())}
    out["same"] = out["kept"]["loss"] == out["regathered"]["loss"] and all(
        torch.equal(g, out["regathered"]["grads"][k]) for k, g in out["kept"]["grads"].items())
    out["buckets"] = sum(len(b) for b in compiled.zero3_buckets.values())
    for k in ("kept", "regathered"):
        del out[k]["grads"]
    return out


def test_zero3_keeps_the_last_gathered_bucket_for_backward(pool2):
    for r in pool2.run(_zero3_keeps_last, timeout=120):
        kept, regathered = r["kept"], r["regathered"]
        assert kept["ref"] <= TOL and kept["ref_loss"] <= TOL and r["same"], r
        assert regathered["gathers"] == kept["gathers"] + 1, r  # the head's bucket, not gathered again
        assert kept["gathers"] >= r["buckets"] + 1, r  # every bucket in forward, some again in backward


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_regather_tells_a_bucket_from_a_later_one_at_the_same_address(monkeypatch):
    """A bucket freed after its forward can have its address taken by a later bucket (another microbatch's,
    another layer's); backward must regather the later bucket's own shard, not serve the first one's copy
    (seen as an out-of-bounds ``as_strided`` on 8 ranks, dp=2 x pp=2 x tp=2 ZeRO-3)."""
    import fxpar.runtime.zero3 as z3

    monkeypatch.setattr(z3, "gather_params", lambda shard, group, dim, dtype, comm=None: torch.cat([shard, shard]))
    regather = Zero3Regather()
    small, large = torch.arange(4.0), torch.arange(100.0, 116.0)
    ptr = 12345  # one address, two buckets in turn
    first = regather._unpack(("zero3", ptr, (small, "dp:0", 0, torch.float32, None), 0, (8,), (1,)))
    assert torch.equal(first, torch.cat([small, small]))
    second = regather._unpack(("zero3", ptr, (large, "dp:0", 0, torch.float32, None), 4, (4, 4), (1, 4)))
    assert torch.equal(second, torch.cat([large, large]).as_strided((4, 4), (1, 4), 4))


def test_regather_holds_a_frozen_and_a_trained_bucket_apart(monkeypatch):
    """A LoRA layer under ZeRO-3 has a bucket of frozen base weights and one of trained adapters, which its
    backward reads in turn (base, adapter, base, ...): each is gathered once, and moving on to the next frozen
    bucket frees the last one."""
    import fxpar.runtime.zero3 as z3

    calls = []

    def gather(shard, group, dim, dtype, comm=None):
        calls.append(shard.data_ptr())
        return torch.cat([shard, shard])
    monkeypatch.setattr(z3, "gather_params", gather)
    regather = Zero3Regather()
    base, adapter, next_base = torch.arange(4.0), torch.ones(2, requires_grad=True), torch.arange(8.0, 12.0)

    def read(shard, ptr):
        return regather._unpack(("zero3", ptr, (shard, "dp:0", 0, torch.float32, None), 0, (4,), (1,)))
    for _ in range(3):
        assert torch.equal(read(base, 1), torch.arange(4.0))
        assert torch.equal(read(adapter, 2), torch.ones(4))
    assert calls == [base.data_ptr(), adapter.data_ptr()]
    read(next_base, 3)
    assert calls == [base.data_ptr(), adapter.data_ptr(), next_base.data_ptr()]
    assert regathered_shards(regather) == {"trained": id(adapter), "frozen": id(next_base)}


def regathered_shards(regather) -> dict:
    return {"frozen" if kind[0] else "trained": id(held[0]) for kind, held in regather.regathered.items()}
