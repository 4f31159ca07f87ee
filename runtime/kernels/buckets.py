"""ZeRO bucket copy-in / copy-out: many tensors packed, cast and padded into one flat buffer (and back)
in one launch, as ``torch.library.custom_op``s in the ``fxpar_kernels`` namespace.

Reads: a bucket's tensors (parameters or fp32 master weights) and its layout,
:class:`~fxpar.ir.buckets.FlatBucket` (tensor ``i`` at ``offsets[i]``, the whole padded with zeros to
``shard_numel * dp``, rank ``r`` owning ``[r * shard_numel, (r + 1) * shard_numel)``). Writes new flat
buffers, or the tensors handed to :func:`copy_out`.

The ops:

* ``pack_shard(tensors, dp, rank, dtype)``: this rank's shard of the bucket cast to ``dtype``, padding
  zeroed: the ZeRO-1/2 engine's fp32 master shard of a bucket of parameters
  (:mod:`fxpar.runtime.data_parallel`), made without the whole flat bucket.
* ``copy_out(flat, outs)``: the gathered flat buffer split back into the tensors ``outs`` (in place,
  cast to their dtype). ``unpack`` wraps it to return new parameter-shaped tensors.

Each op has a torch path (torch's FSDP copy ops, which run on every device)
and a Triton path: one multi-tensor kernel reading a table of data pointers (which path runs:
:func:`fxpar.runtime.kernels.use_triton`; the Triton interpreter runs it on CPU with
``TRITON_INTERPRET=1``). Why a kernel of our own: torch's copy-in casts per tensor through
``_foreach_copy_``; here pack, cast and pad are one pass over the bucket.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence

import torch

from fxpar.ir.buckets import FlatBucket
from fxpar.runtime.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: every op keeps its torch path
    triton = tl = None

__all__ = ["pack_shard", "copy_out", "unpack"]

BLOCK = 1024  # elements per program of the copy kernels


# ---- layouts: segments (tensor, start in the tensor, start in the flat buffer, length) ------------------

@functools.lru_cache(maxsize=256)
def shard_segments(numels: tuple[int, ...], dp: int, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    """The pieces of each tensor inside rank ``rank``'s shard of the FlatBucket, flat start relative to
    the shard's."""
    lo, hi = FlatBucket([str(i) for i in range(len(numels))], [(n,) for n in numels], dp).shard_range(rank)
    out, off = [], 0
    for i, n in enumerate(numels):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((i, a - off, a - lo, b - a))
        off += n
    return tuple(out)


# ---- torch paths ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _fsdp_ops() -> bool:
    """Whether torch's FSDP copy ops are registered (importing FSDP's collectives module does it)."""
    try:
        import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops, "fsdp") and hasattr(torch.ops.fsdp, "all_gather_copy_in")


def _pack_torch(tensors: list[torch.Tensor], segs, out: torch.Tensor) -> None:
    """Copy the segments (back to back from the start of ``out``) into ``out``, cast by the copy; zero the
    rest (the padding)."""
    pieces = [tensors[i].reshape(-1)[s:s + n] for i, s, _, n in segs]
    sizes = [n for *_, n in segs]
    used = sum(sizes)
    out[used:].zero_()
    if not pieces:
        return
    if _fsdp_ops():  # FSDP2's copy-in: one _foreach_copy_ into splits of the buffer
        torch.ops.fsdp.all_gather_copy_in(pieces, out[:used], sizes, used, 0)
    else:
        torch._foreach_copy_(list(out[:used].split(sizes)), pieces)


def _copy_out_torch(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    numels = [o.numel() for o in outs]
    pieces = flat[:sum(numels)]
    if all(o.dtype == flat.dtype and o.is_contiguous() for o in outs):
        torch.split_with_sizes_copy(pieces, numels, out=[o.view(-1) for o in outs])
    else:
        torch._foreach_copy_(outs, [p.view(o.shape) for p, o in zip(pieces.split(numels), outs)])


# ---- Triton path ------------------------------------------------------------------------------------

# Launch tables on the device, by what they are built from (data pointers, dtypes, layout). A training
# step packs and copies out the same buckets every time; building a table on the host and copying it
# over is a fixed cost per launch that made the Triton copy-out 4x slower than torch's on an H100 for a
# 202M-entry bucket (docs/benchmarks.md). The key holds everything a table is made of, so a hit is the
# same table even where memory was freed and reused.
_TABLES: collections.OrderedDict = collections.OrderedDict()
_TABLES_MAX = 512


def cached_tables(key: tuple, build):
    """``build()``'s tensors for ``key``, built once (least recently used dropped past ``_TABLES_MAX``)."""
    hit = _TABLES.get(key)
    if hit is None:
        hit = _TABLES[key] = build()
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return hit


def table_key(what: str, tensors: Sequence[torch.Tensor], *layout) -> tuple:
    return (what, tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors), *layout)


def tables(tensors: list[torch.Tensor], segs, device) -> tuple[torch.Tensor, ...]:
    """Per segment: the data pointer of its tensor, its start there, its flat start and its length."""
    cols = list(zip(*segs)) if segs else [(), (), (), ()]
    ptrs = [tensors[i].data_ptr() + s * tensors[i].element_size() for i, s in zip(cols[0], cols[1])]
    host = torch.tensor([ptrs, list(cols[2]), list(cols[3])], dtype=torch.int64).reshape(3, len(segs))
    host = host.to(device)
    return host[0], host[1], host[2]


def block_ranges(dst: torch.Tensor, lens: torch.Tensor, n_out: int, block: int) -> tuple[torch.Tensor, ...]:
    """For each block of ``block`` flat entries, the first and one past the last segment overlapping it
    (segments sorted by flat start, not overlapping)."""
    starts = torch.arange(0, n_out, block, device=dst.device, dtype=torch.int64)
    first = torch.searchsorted(dst + lens, starts, right=True)
    last = torch.searchsorted(dst, starts + block, right=False)
    return first.to(torch.int32), last.to(torch.int32)


if triton is not None:
    @triton.jit
    def gather_segments(ptrs, dst, lens, first, last, offs, elem_ptr, BLOCK: tl.constexpr):
        """The fp32 values of flat entries ``offs`` from the segments ``first..last``; zeros elsewhere."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(first, last):
            base = tl.load(ptrs + s).to(tl.pointer_type(elem_ptr.dtype.element_ty))
            d0 = tl.load(dst + s)
            inside = (offs >= d0) & (offs < d0 + tl.load(lens + s))
            x = tl.load(base + (offs - d0), mask=inside, other=0.0)
            acc = tl.where(inside, x.to(tl.float32), acc)
        return acc

    @triton.jit
    def _pack_kernel(out, ptrs, dst, lens, firsts, lasts, elem_ptr, n_out, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = gather_segments(ptrs, dst, lens, tl.load(firsts + pid), tl.load(lasts + pid), offs, elem_ptr,
                            BLOCK)
        tl.store(out + offs, x.to(out.dtype.element_ty), mask=offs < n_out)

    @triton.jit
    def scatter_kernel(flat, ptrs, src, lens, blk_seg, blk_start, elem_ptr, scales, shard_numel, n_blocks,
                       DEQUANT: tl.constexpr, QBLOCK: tl.constexpr, BLOCK: tl.constexpr):
        """Flat entries ``src[s] + i`` into segment ``s``'s tensor at ``i``, for this program's block; with
        ``DEQUANT`` each int8 entry times its block's scale (``n_blocks`` scales per rank's shard)."""
        pid = tl.program_id(0)
        s = tl.load(blk_seg + pid)
        offs = tl.load(blk_start + pid) + tl.arange(0, BLOCK)
        inside = offs < tl.load(lens + s)
        pos = tl.load(src + s) + offs
        x = tl.load(flat + pos, mask=inside, other=0).to(tl.float32)
        if DEQUANT:
            r = pos // shard_numel
            x = x * tl.load(scales + r * n_blocks + (pos - r * shard_numel) // QBLOCK, mask=inside, other=0.0)
        base = tl.load(ptrs + s).to(tl.pointer_type(elem_ptr.dtype.element_ty))
        tl.store(base + offs, x.to(elem_ptr.dtype.element_ty), mask=inside)


def _pack_triton(tensors: list[torch.Tensor], segs, out: torch.Tensor) -> None:
    srcs = [t.contiguous() for t in tensors]

    def build():
        ptrs, dst, lens = tables(srcs, segs, out.device)
        return (ptrs, dst, lens, *block_ranges(dst, lens, out.numel(), BLOCK))
    ptrs, dst, lens, first, last = cached_tables(table_key("pack", srcs, segs, out.numel(), out.device), build)
    if len(first):
        _pack_kernel[(len(first),)](out, ptrs, dst, lens, first, last, srcs[0], out.numel(), BLOCK=BLOCK)


def launch_scatter(flat: torch.Tensor, outs: list[torch.Tensor], scales: torch.Tensor | None = None,
                   shard_numel: int = 1, qblock: int = 1) -> None:
    """Copy (or dequantize) ``flat`` into ``outs`` (contiguous, one dtype) with :func:`scatter_kernel`.
    The outputs are written through the pointer table only; a one-entry tensor of their dtype tells the
    kernel the element type."""
    numels = [o.numel() for o in outs]
    segs = [(i, 0, sum(numels[:i]), n) for i, n in enumerate(numels) if n]
    if not segs:
        return

    def build():
        ptrs, src, lens = tables(outs, segs, flat.device)
        per = [math.ceil(n / BLOCK) for *_, n in segs]
        blk_seg = torch.repeat_interleave(torch.arange(len(segs), dtype=torch.int32), torch.tensor(per))
        blk_start = torch.cat([torch.arange(0, n, BLOCK, dtype=torch.int64) for *_, n in segs])
        return ptrs, src, lens, blk_seg.to(flat.device), blk_start.to(flat.device)
    ptrs, src, lens, blk_seg, blk_start = cached_tables(table_key("scatter", outs, flat.device), build)
    scatter_kernel[(len(blk_seg),)](flat, ptrs, src, lens, blk_seg, blk_start,
                                    torch.empty(1, dtype=outs[0].dtype, device=flat.device),
                                    flat if scales is None else scales, shard_numel,
                                    math.ceil(shard_numel / qblock), DEQUANT=scales is not None,
                                    QBLOCK=qblock, BLOCK=BLOCK)


# ---- the ops ----------------------------------------------------------------------------------------

def _check_bucket(tensors: Sequence[torch.Tensor], what: str) -> None:
    if not tensors:
        raise ValueError(f"{what}: a bucket needs at least one tensor")
    if len({t.dtype for t in tensors}) > 1 or len({t.device for t in tensors}) > 1:
        raise ValueError(f"{what}: a bucket's tensors share one dtype and device")


@torch.library.custom_op("fxpar_kernels::pack_shard", mutates_args=())
def pack_shard(tensors: list[torch.Tensor], dp: int, rank: int, dtype: torch.dtype,
               backend: str = "auto") -> torch.Tensor:
    """Rank ``rank``'s shard (``FlatBucket.shard_numel`` entries) of the bucket ``tensors`` over ``dp``
    ranks, cast to ``dtype``."""
    _check_bucket(tensors, "pack_shard")
    segs = shard_segments(tuple(t.numel() for t in tensors), dp, rank)
    out = torch.empty(math.ceil(sum(t.numel() for t in tensors) / dp), dtype=dtype, device=tensors[0].device)
    if use_triton("pack_shard", out.device, backend):
        _pack_triton(list(tensors), segs, out)
    else:
        _pack_torch(list(tensors), segs, out)
    return out


@pack_shard.register_fake
def _(tensors, dp, rank, dtype, backend="auto"):
    return tensors[0].new_empty(math.ceil(sum(t.numel() for t in tensors) / dp), dtype=dtype)


@torch.library.custom_op("fxpar_kernels::copy_out", mutates_args=("outs",))
def copy_out(flat: torch.Tensor, outs: list[torch.Tensor], backend: str = "auto") -> None:
    """The gathered flat buffer ``flat`` (a FlatBucket, padding at the end) into the bucket's tensors
    ``outs``, in order, each cast to its own dtype: the all-gather copy-out."""
    _check_bucket(outs, "copy_out")
    if sum(o.numel() for o in outs) > flat.numel():
        raise ValueError(f"copy_out: {flat.numel()} flat entries cannot fill tensors of "
                         f"{sum(o.numel() for o in outs)}")
    if use_triton("copy_out", flat.device, backend) and all(o.is_contiguous() for o in outs):
        launch_scatter(flat.contiguous(), list(outs))
    else:
        _copy_out_torch(flat, list(outs))


@copy_out.register_fake
def _(flat, outs, backend="auto"):
    return None


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]], dtype: torch.dtype | None = None,
           backend: str = "auto") -> list[torch.Tensor]:
    """New tensors of ``shapes`` (dtype ``dtype``, default the buffer's) from the gathered ``flat``."""
    outs = [torch.empty(tuple(s), dtype=dtype or flat.dtype, device=flat.device) for s in shapes]
    copy_out(flat, outs, backend)
    return outs
