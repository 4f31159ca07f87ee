"""Wire formats of fxpar's collectives: ZeRO++-style int8 communication (``Plan(comm_dtype="int8")``).

Reads: nothing. Writes nothing: names, sizes and checks shared by the op schemas (:mod:`fxpar.ir.ops`),
their kernels (:mod:`fxpar.runtime.collectives`) and the byte counters (:mod:`fxpar.cost.comm`).

Quantized communication is an argument of the ops, not an op of its own, so counts and passes see the
same ``gather_params`` / ``reduce_scatter`` nodes and the byte counters read the format off the node:

* ``gather_params(..., comm_dtype)``: ``"int8"`` gathers each rank's shard as int8 codes + one fp32 scale
  per block of :data:`INT8_BLOCK` entries (ZeRO++ qwZ), dequantized to the compute dtype after the
  gather; ``"int8+grads"`` also quantizes the backward, as ``reduce_scatter(grad, group, dim, "int8")``.
* ``reduce_scatter(..., "int8")``: each rank's slices go as int8 blocks through an all-to-all and the
  receiving rank sums them in fp32 (ZeRO++ qgZ).

Blocks are cut within each rank's slice (the last one may be short), so no rank needs another's
statistics. Numerics and error bounds: :mod:`fxpar.runtime.kernels.quant`.
"""

from __future__ import annotations

import math

from fxpar.ir.errors import CollectiveError

__all__ = ["GATHER_COMM_DTYPES", "INT8_BLOCK", "REDUCE_SCATTER_COMM_DTYPES", "check_comm_dtype",
           "int8_wire_bytes"]

GATHER_COMM_DTYPES = (None, "int8", "int8+grads")
REDUCE_SCATTER_COMM_DTYPES = (None, "int8")
INT8_BLOCK = 256  # entries per fp32 scale: part of the format, every rank must agree on it


def check_comm_dtype(op: str, group: str, comm_dtype, allowed: tuple) -> None:
    if comm_dtype not in allowed:
        raise CollectiveError(f"comm_dtype={comm_dtype!r} is not a wire format of {op}; use one of {allowed}",
                              op=op, group=group)


def int8_wire_bytes(numel: int, n: int, block: int = INT8_BLOCK) -> int:
    """Bytes of ``numel`` entries cut into ``n`` equal slices, each sent as int8 codes and one fp32 scale
    per ``block`` entries (the last block of a slice may be short): ``1 + 4 / block`` per entry."""
    k = math.ceil(numel / n)
    return n * (k + 4 * math.ceil(k / block))
