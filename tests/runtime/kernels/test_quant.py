"""ZeRO++-style block quantization (fxpar.runtime.kernels.quant): the torch path against a per-block
plain-torch reference, the documented error bound |x - deq(q(x))| <= absmax_block / 254, ties rounded
to even, fake kernels; the Triton path against the torch path under the Triton interpreter (one
subprocess: codes and scales bit-exact, dequantization bit-exact to fp32/fp16, within 1 ulp to bf16);
and on 2 gloo ranks an all-gather of int8 codes + scales, dequantized, equal to quantizing and
dequantizing on one process, with the bytes on the wire against a bf16 gather."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.ir.buckets import FlatBucket
from fxpar.runtime.kernels.buckets import pack_shard
from fxpar.runtime.kernels.quant import (
    dequantize,
    dequantize_copy_out,
    quantize_dequantize,
    quantize_shard,
    wire_bytes,
)
from fxpar.testing import multiproc


def _load_helpers():
    spec = importlib.util.spec_from_file_location("_kernels_test_buckets", Path(__file__).with_name("test_buckets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _load_helpers()  # bucket(), reference_flat(), ulps(), run_cases(), interpreter_results()
SHAPES = H.SHAPES
pool2 = multiproc.rank_pool_fixture(2, timeout=60)


def reference_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = absmax x fp32(1/127) (one rounding on every device, unlike a division by a
    scalar), codes = x / scale rounded half to even (0 for a zero block)."""
    codes, scales = [], []
    for i in range(0, x.numel(), block):
        b = x[i:i + block]
        s = b.abs().max() * torch.tensor(1 / 127, dtype=torch.float32)
        codes.append(torch.zeros_like(b, dtype=torch.int8) if s == 0 else torch.round(b / s).to(torch.int8))
        scales.append(s)
    return torch.cat(codes), torch.stack(scales)


def bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per entry: absmax of its block / 254, plus a few fp32 ulps of the absmax."""
    amax = torch.repeat_interleave(torch.stack([x[i:i + block].abs().max() for i in range(0, x.numel(), block)]),
                                   block)[:x.numel()]
    return amax / 254 + amax * 2.0**-21


# ---- torch path ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp,block", [(1, 256), (2, 64), (3, 128), (4, 256)])
def test_quantize_shard_per_rank(dp, block):
    ts = H.bucket(seed=10)
    flat = H.reference_flat(ts, dp, torch.float32)
    fb = FlatBucket([str(i) for i in range(len(ts))], [t.shape for t in ts], dp)
    for rank in range(dp):
        lo, hi = fb.shard_range(rank)
        q, s = quantize_shard(ts, dp, rank, block, backend="torch")
        rq, rs = reference_quant(flat[lo:hi], block)
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.numel() == math.ceil((hi - lo) / block)
        assert torch.equal(q, rq) and torch.equal(s, rs), (dp, rank)


def test_quantize_shard_of_one_tensor_without_packing():
    """A shard that is one piece of one contiguous fp32 tensor is quantized in place of a packed copy
    (ZeRO-3's flat shards, the gradient slices of the quantized reduce-scatter): same codes and scales."""
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(12))
    for dp, rank in ((1, 0), (3, 1), (3, 2)):
        k = x.numel() // dp
        q, s = quantize_shard([x], dp, rank, 256, backend="torch")
        rq, rs = reference_quant(x.view(-1)[rank * k:(rank + 1) * k], 256)
        assert torch.equal(q, rq) and torch.equal(s, rs)
        qt, st = quantize_shard([x.t()], dp, rank, 256, backend="torch")  # not contiguous: packed
        rq, rs = reference_quant(x.t().reshape(-1)[rank * k:(rank + 1) * k], 256)
        assert torch.equal(qt, rq) and torch.equal(st, rs)


@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny", "zeros"])
def test_error_bound(kind):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, generator=g)
    if kind == "outliers":
        x[::97] *= 1000.0
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "zeros":
        x[:512] = 0.0  # whole blocks of zeros: scale 0, codes 0, exact
    block = 256
    deq = quantize_dequantize([x], 1, block, backend="torch")[:x.numel()]
    err = (deq - x).abs()
    assert (err <= bound(x, block)).all(), float((err - bound(x, block)).max())
    # the bound is tight: random data comes close to half a step somewhere
    assert (err / (bound(x, block) + 1e-45)).max() > 0.9
    if kind == "zeros":
        assert torch.equal(deq[:512], torch.zeros(512))


def test_ties_round_half_to_even():
    x = torch.zeros(64)
    x[0] = 127.0  # scale 1: the codes are x rounded
    x[1:7] = torch.tensor([2.5, 3.5, -0.5, -1.5, 0.5, 126.5])
    q, s = quantize_shard([x], 1, 0, 64, backend="torch")
    assert s.item() == 1.0 and q[:7].tolist() == [127, 2, 4, 0, -2, 0, 126]


def test_dequantize_copy_out_into_parameters():
    ts = H.bucket(seed=12)
    dp, block = 2, 128
    parts = [quantize_shard(ts, dp, r, block, backend="torch") for r in range(dp)]
    q, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    flat = dequantize(q, s, dp, block, backend="torch")
    outs = [torch.empty(t.shape, dtype=torch.bfloat16) for t in ts]
    dequantize_copy_out(q, s, dp, block, outs, backend="torch")
    fb = FlatBucket([str(i) for i in range(len(ts))], [t.shape for t in ts], dp)
    for o, v, t in zip(outs, fb.views(flat), ts):
        assert torch.equal(o, v.bfloat16())
        assert ((v - t).abs() <= t.abs().max() / 127).all()  # within a step of each block's absmax


def test_wire_bytes_ratio_and_checks():
    payload, bf16 = wire_bytes(3 * 4096 * 4096, 8, 256)
    assert abs(payload / bf16 - 0.5) <= 0.03 * 0.5 and payload / bf16 > 0.5
    with pytest.raises(ValueError, match="power of two"):
        quantize_shard([torch.ones(8)], 1, 0, 100)
    with pytest.raises(ValueError, match="shards of blocks"):
        dequantize(torch.zeros(10, dtype=torch.int8), torch.zeros(3), 2, 16)


def test_fake_kernels_trace():
    with FakeTensorMode():
        q, s = torch.ops.fxpar_kernels.quantize_shard([torch.empty(100, 3), torch.empty(7)], 2, 1, 64)
        out = torch.empty(100, 3)
        torch.ops.fxpar_kernels.dequantize_copy_out(torch.empty(2 * 154, dtype=torch.int8), torch.empty(6), 2,
                                                    64, [out])
    assert (q.shape, q.dtype, s.shape, s.dtype) == ((154,), torch.int8, (3,), torch.float32)


def test_opcheck():
    ts = [torch.randn(5, 3), torch.randn(7)]
    torch.library.opcheck(torch.ops.fxpar_kernels.quantize_shard, (ts, 2, 1, 16, "torch"))
    q, s = quantize_shard(ts, 1, 0, 16)
    torch.library.opcheck(torch.ops.fxpar_kernels.dequantize_copy_out,
                          (q, s, 1, 16, [torch.empty(5, 3), torch.empty(7)], "torch"))


# ---- Triton path under the interpreter (one subprocess) ----------------------------------------------

def _case_quantize(dp, block):
    ts = H.bucket(seed=13)
    for rank in range(dp):
        q, s = quantize_shard(ts, dp, rank, block, backend="triton")
        rq, rs = quantize_shard(ts, dp, rank, block, backend="torch")
        if not (torch.equal(q, rq) and torch.equal(s, rs)):
            return f"rank {rank}: codes differ at {int((q != rq).sum())}, scales at {int((s != rs).sum())}"


def _case_ties():
    x = torch.zeros(64)
    x[0], x[1:7] = 127.0, torch.tensor([2.5, 3.5, -0.5, -1.5, 0.5, 126.5])
    q, _ = quantize_shard([x], 1, 0, 64, backend="triton")
    return None if q[:7].tolist() == [127, 2, 4, 0, -2, 0, 126] else f"codes {q[:7].tolist()}"


def _case_dequantize(dtype):
    ts = H.bucket(seed=14)
    dp, block = 3, 128
    parts = [quantize_shard(ts, dp, r, block, backend="torch") for r in range(dp)]
    q, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    for shapes in (SHAPES, [(q.numel(),)]):  # the bucket's tensors; the whole flat buffer
        a = [torch.empty(sh, dtype=dtype) for sh in shapes]
        b = [torch.empty(sh, dtype=dtype) for sh in shapes]
        dequantize_copy_out(q, s, dp, block, a, backend="triton")
        dequantize_copy_out(q, s, dp, block, b, backend="torch")
        for x, y in zip(a, b):
            d = H.ulps(x, y)
            if d > (1 if dtype == torch.bfloat16 else 0):
                return f"{d} ulps apart"


CASES = {
    **{f"quantize-dp{dp}-block{b}": (_case_quantize, dp, b) for dp, b in ((1, 64), (2, 256), (3, 128))},
    "ties": (_case_ties,),
    **{f"dequantize-{str(dt)[6:]}": (_case_dequantize, dt) for dt in (torch.float32, torch.float16, torch.bfloat16)},
}


@pytest.fixture(scope="module")
def interpreted():
    return H.interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_path_matches_torch_path(interpreted, case):
    assert interpreted[case] is None, interpreted[case]


# ---- 2 gloo ranks --------------------------------------------------------------------------------------

def _sent_by_all_gathers(fn) -> list[int]:
    """Bytes this rank hands to each torch.distributed all-gather while ``fn()`` runs, counted at the call of
    fxpar.runtime.dist_calls (the runtime's one caller of torch.distributed)."""
    from fxpar.runtime import dist_calls

    reals, sent = (dist_calls.ALL_GATHER_SINGLE, dist_calls.gather_by_broadcasts), []

    def counting(real):
        def call(out, inp, **kw):
            sent.append(inp.numel() * inp.element_size())
            return real(out, inp, **kw)
        return call
    # torch's all-gather, or on gloo fxpar's broadcasts (dist_calls.gather_by_broadcasts)
    dist_calls.ALL_GATHER_SINGLE, dist_calls.gather_by_broadcasts = map(counting, reals)
    try:
        fn()
    finally:
        dist_calls.ALL_GATHER_SINGLE, dist_calls.gather_by_broadcasts = reals
    return sent


def _gather_quantized(block):
    import torch.distributed as dist

    from fxpar.runtime.collectives import all_gather_single
    rank, dp = dist.get_rank(), dist.get_world_size()
    ts = H.bucket([(96, 80), (80,), (200, 96), (13,)], seed=15)
    q, s = quantize_shard(ts, dp, rank, block)
    gq = torch.empty(dp * q.numel(), dtype=torch.int8)
    gs = torch.empty(dp * s.numel(), dtype=torch.float32)
    sent_int8 = _sent_by_all_gathers(lambda: (all_gather_single(gq, q), all_gather_single(gs, s)))
    outs = [torch.empty(t.shape) for t in ts]
    dequantize_copy_out(gq, gs, dp, block, outs)
    local = quantize_dequantize(ts, dp, block)
    fb = FlatBucket([str(i) for i in range(len(ts))], [t.shape for t in ts], dp)
    equal = all(torch.equal(o, v) for o, v in zip(outs, fb.views(local)))
    shard16 = pack_shard(ts, dp, rank, torch.bfloat16)  # the same bucket gathered in bf16
    sent_bf16 = _sent_by_all_gathers(lambda: all_gather_single(
        torch.empty(dp * shard16.numel(), dtype=torch.bfloat16), shard16))
    return equal, sent_int8, sent_bf16


def test_two_rank_quantized_gather(pool2):
    for equal, sent_int8, sent_bf16 in pool2.run(_gather_quantized, 256, timeout=60):
        assert equal
        assert len(sent_int8) == 2 and len(sent_bf16) == 1  # codes, scales; the bf16 shard
        ratio = sum(sent_int8) / sum(sent_bf16)
        assert abs(ratio - 0.5) <= 0.03 * 0.5, ratio


def _zero3_gather(comm_dtype):
    """ZeRO-3's gather_params op on a bucket shard with ``comm_dtype`` (None or "int8"): the gathered
    bucket, the shard's gradient through the op's reduce-scatter, and the gathered bytes as the all-gather
    call sees them."""
    import torch.distributed as dist

    from fxpar.ir.ops import gather_params
    from fxpar.runtime import collectives
    from fxpar.runtime.groups import register_group, unregister_group
    rank, dp = dist.get_rank(), dist.get_world_size()
    ts = H.bucket([(40, 30), (30,), (300,)], seed=16)
    shard = pack_shard(ts, dp, rank, torch.float32).requires_grad_()
    register_group("zq", dist.group.WORLD, size=dp)
    gathered, launch = [], collectives._all_gather_single

    def counting(out, inp, **kw):
        gathered.append(out.numel() * out.element_size())
        return launch(out, inp, **kw)
    collectives._all_gather_single = counting
    try:
        full = gather_params(shard, "zq", 0, torch.bfloat16, comm_dtype)
    finally:
        collectives._all_gather_single = launch
    try:
        (full.float() * torch.arange(full.numel())).sum().backward()
    finally:
        unregister_group("zq")
    return full, quantize_dequantize(ts, dp, 256, torch.bfloat16), shard.grad, gathered


def test_zero3_gather_params_int8(pool2):
    (on, expected, grad_on, bytes_on), _ = pool2.run(_zero3_gather, "int8", timeout=60)
    (off, _, grad_off, bytes_off), _ = pool2.run(_zero3_gather, None, timeout=60)
    assert torch.equal(on, expected)  # the quantized gather is what quantize -> dequantize gives
    assert not torch.equal(on, off) and (on.float() - off.float()).abs().max() < 0.05
    assert torch.equal(grad_on, grad_off)  # "int8" alone: gradients are reduce-scattered unquantized
    assert len(bytes_on) == len(bytes_off) == 1  # codes and scales in one all-gather
    assert abs(bytes_on[0] / bytes_off[0] - 0.5) <= 0.03 * 0.5, (bytes_on, bytes_off)  # int8 + scales vs bf16


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(H.run_cases(CASES)))
