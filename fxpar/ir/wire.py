"""Wire formats of fxpar's collectives: ZeRO++-style int8 communication (``Plan(comm_dtype="int8")``).

Reads: nothing. Writes nothing: one table of formats (:data:`FORMATS`: what each costs on the wire and the
format of its gradient), read by the op records (:mod:`fxpar.ir.collectives`: which op takes which), their
fake and real kernels (:mod:`fxpar.ir.ops`, :mod:`fxpar.runtime.collectives`) and the byte counters
(:mod:`fxpar.cost.comm`), none of which names a format.

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
from dataclasses import dataclass

from fxpar.ir.errors import CollectiveError

__all__ = ["FORMATS", "GATHER_COMM_DTYPES", "INT8_BLOCK", "REDUCE_SCATTER_COMM_DTYPES", "WireFormat",
           "check_comm_dtype", "int8_wire_bytes", "wire_format"]

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


@dataclass(frozen=True)
class WireFormat:
    """A wire format: ``block`` entries per fp32 scale of its int8 codes; ``grads``: the format the
    gradient of an op sending in it goes in (None: the gradient's own dtype)."""

    name: str
    block: int = INT8_BLOCK
    grads: str | None = None

    def wire_bytes(self, numel: int, n: int) -> int:
        """Bytes on the wire of ``numel`` entries cut into ``n`` slices (:func:`int8_wire_bytes`)."""
        return int8_wire_bytes(numel, n, self.block)


FORMATS: dict[str, WireFormat] = {f.name: f for f in (WireFormat("int8"), WireFormat("int8+grads", grads="int8"))}


def wire_format(comm_dtype: str | None) -> WireFormat | None:
    """The format a ``comm_dtype`` argument names; None for the tensor's own dtype."""
    return None if comm_dtype is None else FORMATS[comm_dtype]
