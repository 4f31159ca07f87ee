"""ZeRO++-style block quantization for ZeRO-3 weight gathers: int8 values and one fp32 scale per block,
quantized in the copy-in and dequantized in the copy-out, as ``fxpar_kernels`` custom ops.

Reads: a bucket's tensors (the fp32 master weights) and its :class:`~fxpar.ir.buckets.FlatBucket`
layout; after the all-gather, the gathered int8 values and scales. Writes: this rank's int8 shard and its
scales (:func:`quantize_shard`), or the bucket's tensors (:func:`dequantize_copy_out`).

The scheme: each rank's shard is cut into blocks of ``block`` entries (the last one may be short);
per block, symmetric absmax: ``scale = absmax / 127``, ``q = round_half_even(x / scale)`` in
``[-127, 127]`` (an all-zero block has scale 0 and codes 0), and ``deq = q * scale`` computed in fp32,
then cast to the output dtype. Blocks never straddle two ranks' shards, so every rank quantizes its own
shard and the gathered ``[dp * shard]`` codes with ``[dp * ceil(shard / block)]`` scales dequantize
without any exchange of statistics.

Error bound: rounding to the nearest code is off by at most half a step, so per element
``|x - deq(q(x))| <= absmax_block / 254`` (plus fp32 rounding of ``x / scale`` and ``q * scale``, a few
units in the last place of ``absmax_block``), before any cast of ``deq`` to a narrower output dtype.
Bytes on the wire: ``1 + 4 / block`` per entry against 2 for bf16, 0.508x at block 256.

Where fxpar uses it (``Plan(comm_dtype="int8")``, kernels in :mod:`fxpar.runtime.collectives`):

* weight gathers (ZeRO++ qwZ): every entry of the gathered bucket is within the bound above of the fp32
  master weight, then rounded once to the compute dtype (bf16: a further ``|x| * 2**-9``). A rank's
  forward and its backward regather dequantize the same codes, so both see the same weights.
* gradient reduce-scatter (qgZ, ``quantize_grads``): rank ``r`` quantizes the slice of its gradient that
  rank ``s`` keeps, blocks within that slice; rank ``s`` sums the ``n`` slices in fp32, its own one
  exact. Per entry, ``|sum - exact sum| <= sum over the n - 1 other ranks of absmax_block(r) / 254``
  (plus fp32 rounding of the sum), i.e. at most ``(n - 1) / 254`` of the largest gradient entry in the
  block. The error is unbiased only on average (round-to-nearest), so it is a bounded per-step noise on
  the gradient, not an accumulated drift of the weights, which stay fp32 and exact on the owning rank.

The torch path is plain tensor math on the packed fp32 shard; the Triton path packs (the pointer table of
``fxpar.runtime.kernels.buckets``), casts and quantizes one block per program in one launch, and its
copy-out dequantizes while it scatters. Which path runs: :func:`fxpar.runtime.kernels.use_triton`. Inductor
does not fuse a reduction per block with a multi-tensor gather and an int8 store into one kernel, hence these kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fxpar.ir.quant_ops import INV_QMAX, absmax_int8
from fxpar.ir.wire import int8_wire_bytes
from fxpar.runtime.kernels import buckets, use_triton
from fxpar.runtime.kernels.buckets import shard_segments

tl = buckets.tl
triton = buckets.triton

__all__ = ["quantize_shard", "dequantize_copy_out", "dequantize", "quantize_dequantize", "wire_bytes"]



def _check_block(block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16 (one Triton program per block), not {block}")


def _blocks(shard_numel: int, block: int) -> int:
    return math.ceil(shard_numel / block)


def wire_bytes(numel: int, dp: int, block: int) -> tuple[int, int]:
    """Bytes of one gathered bucket of ``numel`` entries over ``dp`` ranks: (int8 codes + fp32 scales,
    bf16 values), padding included."""
    return int8_wire_bytes(numel, dp, block), dp * math.ceil(numel / dp) * 2


# ---- torch paths ------------------------------------------------------------------------------------

def _quantize_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    pad = _blocks(n, block) * block - n
    xb = (F.pad(x, (0, pad)) if pad else x).view(-1, block)
    q, scale = absmax_int8(xb)
    return q.view(-1)[:n], scale


def _dequantize_torch(q: torch.Tensor, scales: torch.Tensor, dp: int, block: int) -> torch.Tensor:
    shard = q.numel() // dp
    nb = _blocks(shard, block)
    pad = nb * block - shard
    qb = (F.pad(q.view(dp, shard), (0, pad)) if pad else q).view(dp, nb, block)
    deq = qb.to(torch.float32).mul_(scales.view(dp, nb, 1)).view(dp, nb * block)
    return (deq[:, :shard] if pad else deq).reshape(-1)


# ---- Triton path ------------------------------------------------------------------------------------

if triton is not None:
    from fxpar.runtime.kernels.buckets import gather_segments

    INV_SCALE = tl.constexpr(INV_QMAX)

    @triton.jit
    def _quantize_kernel(q, scales, ptrs, dst, lens, firsts, lasts, elem_ptr, n_out, QBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * QBLOCK + tl.arange(0, QBLOCK)
        x = gather_segments(ptrs, dst, lens, tl.load(firsts + pid), tl.load(lasts + pid), offs, elem_ptr, QBLOCK)
        # the scale as the torch path makes it (see fxpar.ir.quant_ops.INV_QMAX); an IEEE division after it, as
        # torch's (Triton's `/` on a GPU is an approximate one)
        scale = tl.max(tl.abs(x), axis=0) * INV_SCALE
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
        # round half to even, as torch.round does (exact in fp32: |y| <= 127)
        f = tl.floor(y)
        frac = y - f
        odd = tl.floor(f * 0.5) != f * 0.5
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(q + offs, r.to(tl.int8), mask=offs < n_out)
        tl.store(scales + pid, scale)


def _quantize_triton(tensors: list[torch.Tensor], segs, q: torch.Tensor, scales: torch.Tensor,
                     block: int) -> None:
    srcs = [t.contiguous() for t in tensors]

    def build():
        ptrs, dst, lens = buckets.tables(srcs, segs, q.device)
        return (ptrs, dst, lens, *buckets.block_ranges(dst, lens, q.numel(), block))
    key = buckets.table_key("quantize", srcs, segs, q.numel(), block, q.device)
    ptrs, dst, lens, first, last = buckets.cached_tables(key, build)
    if len(first):
        _quantize_kernel[(len(first),)](q, scales, ptrs, dst, lens, first, last, srcs[0], q.numel(),
                                        QBLOCK=block)


# ---- the ops ----------------------------------------------------------------------------------------

@torch.library.custom_op("fxpar_kernels::quantize_shard", mutates_args=())
def quantize_shard(tensors: list[torch.Tensor], dp: int, rank: int, block: int = 256,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the bucket ``tensors`` over ``dp`` ranks (FlatBucket layout), packed and
    block-quantized: ``(codes int8 [shard_numel], scales fp32 [ceil(shard_numel / block)])``."""
    _check_block(block)
    buckets._check_bucket(tensors, "quantize_shard")
    segs = shard_segments(tuple(t.numel() for t in tensors), dp, rank)
    shard = math.ceil(sum(t.numel() for t in tensors) / dp)
    device = tensors[0].device
    if use_triton("quantize_shard", device, backend):
        q = torch.empty(shard, dtype=torch.int8, device=device)
        scales = torch.empty(_blocks(shard, block), dtype=torch.float32, device=device)
        _quantize_triton(list(tensors), segs, q, scales, block)
        return q, scales
    if len(segs) == 1 and segs[0][3] == shard:  # the shard is one piece of one tensor, no padding
        i, lo, _, n = segs[0]
        if tensors[i].dtype == torch.float32 and tensors[i].is_contiguous():
            return _quantize_torch(tensors[i].view(-1)[lo:lo + n], block)  # nothing to pack: no copy
    x = torch.empty(shard, dtype=torch.float32, device=device)
    buckets._pack_torch(list(tensors), segs, x)
    return _quantize_torch(x, block)


@quantize_shard.register_fake
def _(tensors, dp, rank, block=256, backend="auto"):
    shard = math.ceil(sum(t.numel() for t in tensors) / dp)
    t = tensors[0]
    return t.new_empty(shard, dtype=torch.int8), t.new_empty(_blocks(shard, block), dtype=torch.float32)


def _check_codes(q: torch.Tensor, scales: torch.Tensor, dp: int, block: int) -> None:
    _check_block(block)
    shard = q.numel() // dp
    if q.numel() != shard * dp or scales.numel() != dp * _blocks(shard, block):
        raise ValueError(f"dequantize_copy_out: {q.numel()} codes and {scales.numel()} scales do not make "
                         f"{dp} shards of blocks of {block}")


@torch.library.custom_op("fxpar_kernels::dequantize_copy_out", mutates_args=("outs",))
def dequantize_copy_out(q: torch.Tensor, scales: torch.Tensor, dp: int, block: int, outs: list[torch.Tensor],
                        backend: str = "auto") -> None:
    """The gathered codes ``q`` (``dp`` shards back to back) and ``scales`` dequantized into the bucket's
    tensors ``outs``, in order, each cast to its own dtype."""
    _check_codes(q, scales, dp, block)
    buckets._check_bucket(outs, "dequantize_copy_out")
    shard = q.numel() // dp
    if sum(o.numel() for o in outs) > q.numel():
        raise ValueError(f"dequantize_copy_out: {q.numel()} codes cannot fill tensors of "
                         f"{sum(o.numel() for o in outs)}")
    if use_triton("dequantize_copy_out", q.device, backend) and all(o.is_contiguous() for o in outs):
        buckets.launch_scatter(q.contiguous(), list(outs), scales.contiguous(), shard, block)
    else:
        buckets._copy_out_torch(_dequantize_torch(q, scales, dp, block), list(outs))


@dequantize_copy_out.register_fake
def _(q, scales, dp, block, outs, backend="auto"):
    return None


def dequantize(q: torch.Tensor, scales: torch.Tensor, dp: int, block: int = 256,
               dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """The whole gathered flat buffer (``q.numel()`` entries, padding included) dequantized to ``dtype``."""
    if not use_triton("dequantize_copy_out", q.device, backend):  # one cast of the fp32 result, no buffer
        _check_codes(q, scales, dp, block)
        return _dequantize_torch(q, scales, dp, block).to(dtype)
    out = torch.empty(q.numel(), dtype=dtype, device=q.device)
    dequantize_copy_out(q, scales, dp, block, [out], backend)
    return out


def quantize_dequantize(tensors: list[torch.Tensor], dp: int, block: int = 256,
                        dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """What a quantized all-gather of the bucket ``tensors`` delivers, computed on one process: every
    rank's shard quantized, then the flat buffer dequantized."""
    parts = [quantize_shard(tensors, dp, r, block, backend) for r in range(dp)]
    return dequantize(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), dp, block,
                      dtype, backend)
