"""The catalogue of fxpar's hand-written kernels (``fxpar.runtime.kernels``): one record per kernel.

Reads: nothing. Writes nothing (one table, built at import).

Why in the vocabulary layer and not in ``runtime/kernels/`` itself: the report names the kernels a
compiled model runs and may not import the runtime (``docs/design.md``, layering), and passes emit some of
these ops without it. So the kernels' descriptions stand here, once, beside the schemas of the ones graphs
hold (:mod:`fxpar.ir.fused_ops`, :mod:`fxpar.ir.collective_matmul_ops`); a new kernel in
``runtime/kernels/<x>.py`` adds its :class:`Kernel` entry here. A fused kernel that runs one of fxpar's
collectives inside is counted as that collective by its record (:class:`fxpar.ir.collectives.Collective`
``fused``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KERNELS", "Kernel"]


@dataclass(frozen=True)
class Kernel:
    """``name``: the op's name in ``fxpar_kernels``; ``module``: its module under ``fxpar.runtime.kernels``;
    ``what``: what it does, for the report; ``triton``: whether it has a Triton path (False: torch's ops on
    every device, its work being matmuls and collectives)."""

    name: str
    module: str
    what: str
    triton: bool = True


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("linear_cross_entropy", "cross_entropy",
           "fused LM head + vocabulary-parallel cross-entropy, chunked over tokens"),
    Kernel("all_gather_linear", "collective_matmul",
           "sequence-parallel all-gather -> linears, chunked, chunk i+1 in flight during chunk i", triton=False),
    Kernel("linear_reduce_scatter", "collective_matmul",
           "linear -> sequence-parallel reduce-scatter, chunked, overlapping the next chunk", triton=False),
    Kernel("quantize_shard", "quant", "int8 block quantization of a ZeRO-3 shard (copy-in of the gather)"),
    Kernel("dequantize_copy_out", "quant", "int8 dequantization of a gathered bucket (copy-out)"),
    Kernel("pack_shard", "buckets", "ZeRO-1/2 fp32 master shard of a parameter bucket (cast, padded, one launch)"),
    Kernel("copy_out", "buckets", "gathered bucket split back into the parameters (one launch)"),
    Kernel("chunk_attention", "chunk_attention", "attention of a query chunk over a key chunk, with its log-sum-exp"),
)}
