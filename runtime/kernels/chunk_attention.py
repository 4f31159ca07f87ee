"""Attention of a chunk of queries over a chunk of keys, with its log-sum-exp: the local step of context
parallelism (issue 27). ``torch.ops.fxpar_kernels.chunk_attention`` and ``chunk_attention_backward``.

Reads: ``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` (``H`` a multiple of ``Hkv``: grouped-query heads,
query head ``h`` reads KV head ``h // (H // Hkv)``), an optional mask broadcastable to ``[B, H, Sq, Sk]``
(bool, True = attend; or additive float), the scale (default ``D ** -0.5``) and an optional Gemma-2 soft
cap (scores ``softcap * tanh(s / softcap)``, capped before the mask is applied). Writes: ``out`` (q's dtype)
and ``lse`` (fp32 ``[B, H, Sq]``, the log-sum-exp of the scaled, capped, masked scores); a row with no
key to attend gives ``out`` 0 and ``lse`` -inf, never NaN. No communication: a ring or an all-gather of
KV around these merges the chunks' results with :func:`merge_partials`, and runs the backward of each
key chunk from the merged ``out`` and ``lse`` (flash attention's backward: ``P = exp(S - lse)``,
``dS = P * (dO V^T - rowsum(dO * O))``), which is then that chunk's exact share of the gradients, so
no chunk's probabilities are kept from forward to backward.

Paths (:func:`fxpar.runtime.kernels.use_triton`, op name "chunk_attention"; by default Triton on CUDA for
16-bit inputs, torch otherwise):
* torch, on the CPU without soft cap: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward, which return the log-sum-exp and take ``out``/``lse`` back, never forming the ``[Sq, Sk]``
  scores whole. They take no bool mask (made additive) nor grouped KV (KV repeated per query head), and
  give ``lse`` 0 on rows with no key (set to -inf here).
* torch, elsewhere (soft cap, other devices): plain matmul / softmax in fp32, the query heads of a
  group batched against their one KV head; it forms the ``[Sq, Sk]`` scores.
* Triton (hand-written because torch's attention kernels return no log-sum-exp that a later call can
  take back with a soft cap, nor read grouped KV heads in place): a flash-attention forward (one program
  per query tile and head, online softmax over key tiles) and backward (one program per key tile and KV
  head for dK/dV, looping over the query heads that share it, so the group's sum needs no atomics; one
  per query tile and head for dQ). KV is read per KV head, never repeated. fp32 matmuls are asked for
  at IEEE precision (not TF32), as the torch path computes them. No tile is skipped: a causal mask's
  empty tiles cost as much as full ones (the mask is data, read tile by tile).
"""

from __future__ import annotations

import torch

from fxpar.ir.errors import FxparError
from fxpar.runtime.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is only declared for Linux x86-64
    triton = None

__all__ = ["chunk_attention", "chunk_attention_backward", "merge_partials", "sink_grad"]

BLOCK = 64  # query and key rows per Triton tile (tests lower it to run several tiles under the interpreter)
_NEG_INF = float("-inf")


def _check(q, k, v):
    if (q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]
            or q.shape[1] % k.shape[1]):
        raise FxparError(f"chunk_attention: q [B, H, Sq, D] and k, v [B, Hkv, Sk, D] with H a multiple of Hkv "
                         f"expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as an additive float mask of ``dtype`` (bool: 0 where attended, -inf elsewhere)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, _NEG_INF)


def _flash_cpu(q: torch.Tensor, softcap: float | None) -> bool:
    return q.device.type == "cpu" and softcap is None and q.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """KV ``[B, Hkv, S, D]`` repeated to ``[B, H, S, D]`` (a copy: the CPU flash kernel reads one per head)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _grouped(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """A ``[B, H, ...]`` tensor (or one with 1 head, broadcast) as ``[B, Hkv, H // Hkv, ...]``."""
    return t.unsqueeze(2) if t.shape[1] == 1 else t.unflatten(1, (hkv, t.shape[1] // hkv))


def _math_scores(q, k, mask, scale, softcap):
    """fp32 scores ``[B, Hkv, G, Sq, Sk]`` (scaled, capped, masked) and the tanh of the cap (or None)."""
    s = torch.matmul(_grouped(q.float(), k.shape[1]), k.float()[:, :, None].transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if mask is not None:
        m = _grouped(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)), k.shape[1])
        s = s.masked_fill(~m, _NEG_INF) if m.dtype == torch.bool else s + m.float()
    return s, t


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows with no key) as 0, so that ``exp(s - lse)`` is 0 there and not NaN."""
    return lse.masked_fill(lse == _NEG_INF, 0.0)


def _forward_torch(q, k, v, mask, scale, softcap):
    b, h, sq, d = q.shape
    if _flash_cpu(q, softcap):
        add = _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _per_query_head(k, h), _per_query_head(v, h), 0.0, False, attn_mask=add, scale=scale)
        dead = None if add is None else (add == _NEG_INF).all(-1)  # rows with no key to attend
        return out, (lse if dead is None else lse.masked_fill(dead, _NEG_INF)).contiguous()
    s, _ = _math_scores(q, k, mask, scale, softcap)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - _finite(lse)[..., None])
    out = torch.matmul(p, v.float()[:, :, None])
    return out.reshape(b, h, sq, d).to(q.dtype), lse.reshape(b, h, sq)


def _backward_torch(q, k, v, out, lse, grad_out, mask, scale, softcap):
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if _flash_cpu(q, softcap):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, _per_query_head(k, h), _per_query_head(v, h), out, _finite(lse), 0.0, False,
            attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq, dk.reshape(b, hkv, -1, sk, d).sum(2), dv.reshape(b, hkv, -1, sk, d).sum(2)
    s, t = _math_scores(q, k, mask, scale, softcap)
    p = torch.exp(s - _grouped(_finite(lse), hkv)[..., None])
    dout = _grouped(grad_out.float(), hkv)
    delta = (dout * _grouped(out.float(), hkv)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = p * (torch.matmul(dout, v.float()[:, :, None].transpose(-1, -2)) - delta)
    if t is not None:
        ds = ds * (1 - t * t)  # d(c tanh(x / c)) / dx
    dq = torch.matmul(ds, k.float()[:, :, None]) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), hkv)).sum(2) * scale
    return dq.reshape(b, h, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton path

if triton is not None:

    @triton.jit
    def _tanh(x):
        # tl has no tanh, and libdevice's does not run under the interpreter. tanh(x) = e / (e + 2) with
        # e = expm1(2|x|), expm1 by Kahan's (u - 1) * y / log(u): a few ulp, where 1 - 2 / (exp(2x) + 1)
        # loses all but the leading digits for small x (and so the scores, times the cap).
        y = tl.minimum(2.0 * tl.abs(x), 40.0)
        u = tl.exp(y)
        e = tl.where(u == 1.0, y, (u - 1.0) * y / tl.log(tl.where(u == 1.0, 2.0, u)))
        t = e / (e + 2.0)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _scores(q, k, m_ptr, rm, rn, sq, sk, smq, smk, scale, cap,
                MASK: tl.constexpr, CAP: tl.constexpr, PREC: tl.constexpr):
        """A tile's scores (scaled, capped, masked, -inf outside the chunk) and tanh of the cap."""
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        t = s
        if CAP:
            t = _tanh(s / cap)
            s = t * cap
        valid = (rm[:, None] < sq) & (rn[None, :] < sk)
        if MASK == 1:  # bool mask, read as uint8
            keep = tl.load(m_ptr + rm[:, None] * smq + rn[None, :] * smk, mask=valid, other=0)
            valid = valid & (keep != 0)
        if MASK == 2:  # additive mask
            s += tl.load(m_ptr + rm[:, None] * smq + rn[None, :] * smk, mask=valid, other=0.0).to(tl.float32)
        return tl.where(valid, s, float("-inf")), t

    @triton.jit
    def _tile(ptr, rows, n_rows, rd, d, stride):
        return tl.load(ptr + rows[:, None] * stride + rd[None, :], mask=(rows[:, None] < n_rows) & (rd[None, :] < d),
                       other=0.0)

    @triton.jit
    def _fwd_kernel(Q, K, V, M, OUT, L, scale, cap, H, GROUP, SQ, SK, D, qs_b, qs_h, qs_s, ks_b, ks_h, ks_s,
                    ms_b, ms_h, ms_q, ms_k, os_b, os_h, os_s, MASK: tl.constexpr, CAP: tl.constexpr,
                    PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        b, h = tl.program_id(1) // H, tl.program_id(1) % H
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rd = tl.arange(0, BD)
        q = _tile(Q + b * qs_b + h * qs_h, rm, SQ, rd, D, qs_s)
        kv = b * ks_b + (h // GROUP) * ks_h
        m_ptr = M + b * ms_b + h * ms_h
        top = tl.full((BM,), float("-inf"), tl.float32)
        total = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, BD), tl.float32)
        for start in range(0, SK, BN):  # online softmax over the key tiles
            rn = start + tl.arange(0, BN)
            k = _tile(K + kv, rn, SK, rd, D, ks_s)
            s, _ = _scores(q, k, m_ptr, rm, rn, SQ, SK, ms_q, ms_k, scale, cap, MASK, CAP, PREC)
            new_top = tl.maximum(top, tl.max(s, 1))
            base = tl.where(new_top == float("-inf"), 0.0, new_top)  # no key yet: keep exp(-inf) = 0
            p = tl.exp(s - base[:, None])
            alpha = tl.exp(top - base)
            v = _tile(V + kv, rn, SK, rd, D, ks_s)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            top = new_top
        lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + b * os_b + h * os_h + rm[:, None] * os_s + rd[None, :], out.to(OUT.dtype.element_ty),
                 mask=(rm[:, None] < SQ) & (rd[None, :] < D))
        tl.store(L + (b * H + h) * SQ + rm, lse, mask=rm < SQ)

    @triton.jit
    def _probs_grad(q, k, v, do, lse, delta, m_ptr, rm, rn, SQ, SK, ms_q, ms_k, scale, cap,
                    MASK: tl.constexpr, CAP: tl.constexpr, PREC: tl.constexpr):
        """A tile's probabilities ``P`` and the scores' gradient ``dS`` (through the cap), both [BM, BN]."""
        s, t = _scores(q, k, m_ptr, rm, rn, SQ, SK, ms_q, ms_k, scale, cap, MASK, CAP, PREC)
        p = tl.exp(s - lse[:, None])  # lse is finite here: -inf rows were made 0, their p is exp(-inf)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        if CAP:
            ds = ds * (1.0 - t * t)
        return p, ds

    @triton.jit
    def _bwd_kv_kernel(Q, K, V, M, DO, L, DELTA, DK, DV, scale, cap, H, GROUP, SQ, SK, D, qs_b, qs_h, qs_s,
                       ks_b, ks_h, ks_s, ms_b, ms_h, ms_q, ms_k, MASK: tl.constexpr, CAP: tl.constexpr,
                       PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        hkv = H // GROUP
        b, g = tl.program_id(1) // hkv, tl.program_id(1) % hkv
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rd = tl.arange(0, BD)
        kv = b * ks_b + g * ks_h
        k = _tile(K + kv, rn, SK, rd, D, ks_s)
        v = _tile(V + kv, rn, SK, rd, D, ks_s)
        dk = tl.zeros((BN, BD), tl.float32)
        dv = tl.zeros((BN, BD), tl.float32)
        for h in range(g * GROUP, (g + 1) * GROUP):  # the query heads sharing this KV head, summed here
            qo = b * qs_b + h * qs_h  # q and dO share a layout (made so by the launcher)
            for start in range(0, SQ, BM):
                rm = start + tl.arange(0, BM)
                q = _tile(Q + qo, rm, SQ, rd, D, qs_s)
                do = _tile(DO + qo, rm, SQ, rd, D, qs_s)
                lse = tl.load(L + (b * H + h) * SQ + rm, mask=rm < SQ, other=0.0)
                delta = tl.load(DELTA + (b * H + h) * SQ + rm, mask=rm < SQ, other=0.0)
                p, ds = _probs_grad(q, k, v, do, lse, delta, M + b * ms_b + h * ms_h, rm, rn, SQ, SK, ms_q, ms_k,
                                    scale, cap, MASK, CAP, PREC)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        store = (rn[:, None] < SK) & (rd[None, :] < D)
        tl.store(DK + kv + rn[:, None] * ks_s + rd[None, :], (dk * scale).to(DK.dtype.element_ty), mask=store)
        tl.store(DV + kv + rn[:, None] * ks_s + rd[None, :], dv.to(DV.dtype.element_ty), mask=store)

    @triton.jit
    def _bwd_q_kernel(Q, K, V, M, DO, L, DELTA, DQ, scale, cap, H, GROUP, SQ, SK, D, qs_b, qs_h, qs_s,
                      ks_b, ks_h, ks_s, ms_b, ms_h, ms_q, ms_k, MASK: tl.constexpr, CAP: tl.constexpr,
                      PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        b, h = tl.program_id(1) // H, tl.program_id(1) % H
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rd = tl.arange(0, BD)
        qo = b * qs_b + h * qs_h
        q = _tile(Q + qo, rm, SQ, rd, D, qs_s)
        do = _tile(DO + qo, rm, SQ, rd, D, qs_s)
        lse = tl.load(L + (b * H + h) * SQ + rm, mask=rm < SQ, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * SQ + rm, mask=rm < SQ, other=0.0)
        kv = b * ks_b + (h // GROUP) * ks_h
        dq = tl.zeros((BM, BD), tl.float32)
        for start in range(0, SK, BN):
            rn = start + tl.arange(0, BN)
            k = _tile(K + kv, rn, SK, rd, D, ks_s)
            v = _tile(V + kv, rn, SK, rd, D, ks_s)
            _, ds = _probs_grad(q, k, v, do, lse, delta, M + b * ms_b + h * ms_h, rm, rn, SQ, SK, ms_q, ms_k,
                                scale, cap, MASK, CAP, PREC)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        tl.store(DQ + qo + rm[:, None] * qs_s + rd[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=(rm[:, None] < SQ) & (rd[None, :] < D))


def _triton(q: torch.Tensor) -> bool:
    """Whether the Triton path runs (:func:`fxpar.runtime.kernels.use_triton`); by default fp32 takes torch's
    on CUDA too. On an H200 (2048 x 2048 causal, 16-32 query heads over 8 KV heads, head dim 64-256) the
    torch path (fp32 matmuls) took 3.9-9.0x the Triton forward's time, 3.0-4.7x its backward's and 16-96x its
    memory with 16-bit inputs; with fp32 ones (Triton's matmuls at IEEE precision, without tensor cores) the
    Triton forward took 1.2-1.9x and its backward 35-37x the torch path's time."""
    if not use_triton("chunk_attention", q.device):
        return False
    return q.dtype != torch.float32 or use_triton("chunk_attention", torch.device("meta"))  # meta: asked for


def _launch_args(q, k, v, mask, softcap):
    """Contiguous q, k, v, the mask (tensor, its 4 strides over [B, H, Sq, Sk]) and the constexprs."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kind = 0 if mask is None else 1 if mask.dtype == torch.bool else 2
    if mask is None:
        m, strides = q, (0, 0, 0, 0)
    else:
        m = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # a view: broadcast dims have stride 0
        m = m.view(torch.uint8) if kind == 1 else m
        strides = m.stride()
    bd = max(16, triton.next_power_of_2(q.shape[3]))
    # rows of 256 bytes at most in 64-row tiles: the backward's tiles of fp32 with D = 128, or bf16 with D = 256,
    # took 237,568-239,104 bytes of shared memory on an H200, over its 232,448
    block = BLOCK if bd * q.element_size() <= 256 else max(16, BLOCK // 2)
    consts = dict(MASK=kind, CAP=softcap is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  BM=block, BN=block, BD=bd)
    return q, k, v, m, strides, consts


def _forward_triton(q, k, v, mask, scale, softcap):
    q, k, v, m, ms, consts = _launch_args(q, k, v, mask, softcap)
    (b, h, sq, d), hkv, sk = q.shape, k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    _fwd_kernel[(triton.cdiv(sq, consts["BM"]), b * h)](
        q, k, v, m, out, lse, scale, softcap or 1.0, h, h // hkv, sq, sk, d, *q.stride()[:3], *k.stride()[:3],
        *ms, *out.stride()[:3], **consts)
    return out, lse


def _backward_triton(q, k, v, out, lse, grad_out, mask, scale, softcap):
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O), flash's D
    q, k, v, m, ms, consts = _launch_args(q, k, v, mask, softcap)
    grad_out = grad_out.to(q.dtype).contiguous()
    lse = _finite(lse.float()).contiguous()
    (b, h, sq, d), hkv, sk = q.shape, k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    shared = (scale, softcap or 1.0, h, h // hkv, sq, sk, d, *q.stride()[:3], *k.stride()[:3], *ms)
    _bwd_kv_kernel[(triton.cdiv(sk, consts["BN"]), b * hkv)](q, k, v, m, grad_out, lse, delta, dk, dv, *shared,
                                                               **consts)
    _bwd_q_kernel[(triton.cdiv(sq, consts["BM"]), b * h)](q, k, v, m, grad_out, lse, delta, dq, *shared, **consts)
    return dq, dk, dv


# ---- the ops ---------------------------------------------------------------------------------------
@torch.library.custom_op("fxpar_kernels::chunk_attention", mutates_args=())
def chunk_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` over ``k, v`` (see the module docstring)."""
    _check(q, k, v)
    run = _forward_triton if _triton(q) else _forward_torch
    return run(q, k, v, mask, scale, softcap)


@chunk_attention_op.register_fake
def _(q, k, v, mask, scale, softcap):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fxpar_kernels::chunk_attention_backward", mutates_args=())
def chunk_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, grad_out: torch.Tensor, mask: torch.Tensor | None, scale: float,
                                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this key chunk from the (possibly merged over chunks) ``out`` and ``lse``."""
    _check(q, k, v)
    run = _backward_triton if _triton(q) else _backward_torch
    return run(q, k, v, out, lse, grad_out, mask, scale, softcap)


@chunk_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, mask, scale, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _floats(q: torch.Tensor, scale: float | None, softcap: float | None) -> tuple[float, float | None]:
    return float(q.shape[-1] ** -0.5 if scale is None else scale), None if softcap is None else float(softcap)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, H, Sq, D]`` over ``k, v [B, Hkv, Sk, D]``: ``(out [B, H, Sq, D] in q's dtype,
    lse [B, H, Sq] fp32)``. ``mask``: bool (True = attend) or additive float, broadcastable to
    ``[B, H, Sq, Sk]``; None attends to every key. ``softcap``: scores ``softcap * tanh(s / softcap)``
    before the mask. Rows with no key to attend: ``out`` 0, ``lse`` -inf. ``sinks``: gpt-oss's logit per
    query head ``[H]`` in the softmax's denominator, merged in as a partial with no value (give them with
    one key chunk of a ring only; :func:`chunk_attention_backward` needs nothing more, :func:`sink_grad`)."""
    out, lse = torch.ops.fxpar_kernels.chunk_attention(q, k, v, mask, *_floats(q, scale, softcap))
    if sinks is None:
        return out, lse
    return merge_partials(out, lse, torch.zeros_like(out), sinks.float()[:, None].expand(lse.shape))


def chunk_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, grad_out: torch.Tensor, mask: torch.Tensor | None = None, *,
                             scale: float | None = None, softcap: float | None = None):
    """``(dq, dk, dv)`` of :func:`chunk_attention` from its ``out`` and ``lse`` and the gradient of ``out``;
    ``dk``, ``dv`` summed over the query heads that share a KV head. Given the ``out`` and ``lse`` merged
    over several key chunks, the result is this key chunk's share: ``dq`` summed over the chunks, and
    ``dk``, ``dv`` of each chunk, are the gradients of attention over all of them."""
    return torch.ops.fxpar_kernels.chunk_attention_backward(q, k, v, out, lse, grad_out, mask,
                                                            *_floats(q, scale, softcap))


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's ``(out, lse)``: ``lse`` their
    log-add-exp, ``out`` the outputs weighted by ``exp(lse_x - lse)`` (in fp32; ``out_a``'s dtype). Rows
    with no key in one set (lse -inf) take the other's; in neither, out 0 and lse -inf. Attention sinks
    (gpt-oss) are such a partial, merged once: out 0, lse the head's sink logit."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    out = out_a.float() * torch.exp(lse_a - base)[..., None] + out_b.float() * torch.exp(lse_b - base)[..., None]
    return out.to(out_a.dtype), lse


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sinks [H]`` from the ``out`` and ``lse`` of attention that counted them (merged over
    every key chunk) and the gradient of ``out``: ``-sum over batch and queries of exp(sink - lse) *
    rowsum(dO * O)``. Under context parallelism each rank's is a share over its queries, to be summed."""
    delta = (grad_out.float() * out.float()).sum(-1)
    return -(torch.exp(sinks.float()[:, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
