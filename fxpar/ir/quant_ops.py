"""A linear layer over a block-quantized frozen weight (QLoRA's base, ``Plan(base_dtype="int8" | "nf4")``):
``torch.ops.fxpar_kernels.int8_linear`` (``nf4_linear``: the same over :mod:`fxpar.ir.nf4`'s 4-bit blocks;
each format has its ``_linear_backward`` and ``_embedding``, :data:`FORMATS`), what ``passes/quantize_base.py``
emits in place of ``aten.linear``.

Reads: the input ``x [..., in]``, the weight's int8 codes ``[out, blocks * block]`` and fp32 scales
``[out, blocks]`` (:func:`quantize_rows`), an optional bias. Writes: ``x @ W.T + bias`` with
``W = codes * scales`` (per block, fp32, cast to ``x``'s dtype), computed per call: the full-precision weight
exists only while its layer runs, forward or backward.

The scheme is :mod:`fxpar.runtime.kernels.quant`'s (symmetric absmax, ``scale = absmax * (1 / 127)``, codes
rounded half to even in ``[-127, 127]``, an all-zero block has scale 0), with blocks along each row's input
features: a row of ``in`` entries is ``ceil(in / block)`` blocks, the last one zero-padded. The weight held
is ``1 + 4 / block`` bytes per entry (block 64: 0.266x fp32). Under TP the pass runs after the cut, so each
rank quantizes its own shard and no block straddles two ranks.

Backward: the weight is frozen (no gradient for codes or scales); ``dx = dy @ W`` dequantizes ``W`` again
from the codes, which is all autograd keeps besides ``x``'s shape; the bias, if trainable, gets ``dy``
summed. The torch path runs on every device (no Triton kernel yet: on CUDA the dequantize and the matmul
are two kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxpar.ir.nf4 import dequantize_nf4, quantize_nf4

__all__ = ["BLOCK", "FORMATS", "HELD_BYTES", "INV_QMAX", "QMAX", "absmax_int8", "dequantize_rows", "held_weight",
           "int8_embedding", "int8_linear", "nf4_embedding", "nf4_linear", "quantize_rows"]

BLOCK = 64  # entries per scale along the input features: bitsandbytes' QLoRA block, 0.266x fp32 held
QMAX = 127  # symmetric int8 codes in [-127, 127]
# A block's scale is its largest magnitude times the fp32 nearest 1/127, on every path: torch on CUDA divides
# by a Python scalar as a multiplication by its reciprocal while on the CPU it divides, so "amax / 127"
# gave scales an ulp apart and codes one apart at near-ties between the GPU's Triton and torch paths
# (measured on an H100, docs/benchmarks.md "GPU checks"). A multiplication is one rounding everywhere.
INV_QMAX = 1.0 / QMAX


def absmax_int8(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks along the last dim of ``xb`` (fp32) -> (int8 codes, fp32 scale per block): the one scheme of
    fxpar's int8 blocks (this module's weights, :mod:`fxpar.runtime.kernels.quant`'s wire)."""
    scale = xb.abs().amax(dim=-1) * INV_QMAX  # see INV_QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(xb, safe[..., None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)  # in place: one buffer
    return q, scale


def quantize_rows(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (int8 codes ``[out, ceil(in / block) * block]``, fp32 scales ``[out, ceil(in / block)]``);
    a row narrower than ``block`` is one block of its width (no padding held)."""
    out, n = w.shape
    block = min(block, n)
    pad = -n % block
    q, scale = absmax_int8(F.pad(w.detach().to(torch.float32), (0, pad)).view(out, -1, block))
    return q.view(out, -1), scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in_features]`` weight the codes and scales of :func:`quantize_rows` stand for."""
    out, nb = scales.shape
    w = codes.view(out, nb, -1).to(torch.float32).mul_(scales[..., None]).view(out, -1)
    return w[:, :in_features].to(dtype)


def held_weight(modules, fqn: str, like: torch.Tensor, gathered=None) -> torch.Tensor | None:
    """The weight ``fqn`` (``like``: its meta stand-in) dequantized from the ``<fqn>_<format>`` codes and
    scales (a format of :data:`FORMATS`) one of ``modules`` (a rank's stage modules) holds, or under ZeRO-3
    ``gathered`` (a :class:`~fxpar.runtime.zero3.Zero3Gatherer`) gathers; None where none holds them."""
    for fmt, (_, dequantize) in FORMATS.items():
        codes_name, scales_name = f"{fqn}_{fmt}", f"{fqn}_{fmt}_scales"
        if gathered is not None and codes_name in gathered:
            return dequantize(gathered[codes_name], gathered[scales_name], like.shape[1], like.dtype)
        for root in modules:
            try:
                codes, scales = root.get_buffer(codes_name), root.get_buffer(scales_name)
            except AttributeError:
                continue
            return dequantize(codes, scales, like.shape[1], like.dtype)
    return None


def _define(fmt: str, dequantize):
    """``fxpar_kernels.<fmt>_linear`` (autograd: ``<fmt>_linear_backward``) and ``<fmt>_embedding`` over the
    blocks ``dequantize(codes, scales, in_features, dtype)`` reads: one family per format of :data:`FORMATS`."""
    @torch.library.custom_op(f"fxpar_kernels::{fmt}_linear", mutates_args=())
    def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               in_features: int) -> torch.Tensor:
        return F.linear(x, dequantize(codes, scales, in_features, x.dtype), bias)

    @linear.register_fake
    def _fake(x, codes, scales, bias, in_features):
        return x.new_empty((*x.shape[:-1], codes.shape[0]))

    @torch.library.custom_op(f"fxpar_kernels::{fmt}_linear_backward", mutates_args=())
    def linear_backward(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        in_features: int) -> torch.Tensor:
        """``dy @ W``: the input's gradient, ``W`` dequantized again."""
        return grad @ dequantize(codes, scales, in_features, grad.dtype)

    @linear_backward.register_fake
    def _backward_fake(grad, codes, scales, in_features):
        return grad.new_empty((*grad.shape[:-1], in_features))

    def _setup_context(ctx, inputs, output):
        x, codes, scales, bias, in_features = inputs
        ctx.save_for_backward(codes, scales)
        ctx.in_features = in_features
        ctx.bias_grad = bias is not None and bias.requires_grad

    def _backward(ctx, grad):
        codes, scales = ctx.saved_tensors
        dx = linear_backward(grad, codes, scales, ctx.in_features) if ctx.needs_input_grad[0] else None
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return dx, None, None, db, None

    linear.register_autograd(_backward, setup_context=_setup_context)

    @torch.library.custom_op(f"fxpar_kernels::{fmt}_embedding", mutates_args=())
    def embedding(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
        """``embedding(W, ids)`` of a frozen table held as blocks: only the rows read are dequantized. No
        gradient (the table is frozen and ids are integers)."""
        return dequantize(codes[ids.reshape(-1)], scales[ids.reshape(-1)], in_features).view(*ids.shape, -1)

    @embedding.register_fake
    def _embedding_fake(codes, scales, ids, in_features):
        return scales.new_empty((*ids.shape, in_features))

    return linear, linear_backward, embedding


int8_linear, int8_linear_backward, int8_embedding = _define("int8", dequantize_rows)
nf4_linear, nf4_linear_backward, nf4_embedding = _define("nf4", dequantize_nf4)
# Plan(base_dtype=...) -> (quantize(w) -> (codes, scales), dequantize(codes, scales, in_features, dtype))
FORMATS = {"int8": (quantize_rows, dequantize_rows), "nf4": (quantize_nf4, dequantize_nf4)}
# Plan(base_dtype=...) -> bytes held per frozen entry, codes + an fp32 scale per block (the cost model's price)
HELD_BYTES = {None: 4.0, "int8": 1 + 4 / BLOCK, "nf4": 0.5 + 4 / BLOCK}
