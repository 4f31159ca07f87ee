"""What autograd keeps from forward for backward, read from a graph: the tensors each op's backward
needs (torch's derivative formulas, by op family), named by storage so that a view counts with its base.

Reads node ``val`` (FakeTensors: shape, dtype and storage identity, which torch.export's and
FakeTensorProp's propagation keep: a view's value shares its base's storage) and the program's input
bindings (parameters, buffers and constants are not activations). Writes nothing.

Attention is assumed fused (flash / memory-efficient, as on GPUs and CPU training): it keeps its
inputs, its output and a float32 log-sum-exp per query row, never the score matrix; a boolean mask is
turned into a float bias by each call, which it keeps. An op the table
does not know is assumed to keep every tensor operand (an over-estimate, never an under-estimate).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxpar.ir import meta
from fxpar.ir.analysis import grad_flow
from fxpar.ir.numeric import nbytes, to_int
from fxpar.ir.op_classes import (
    GRAD_READS_CROSS,
    GRAD_READS_INDEX,
    GRAD_READS_INPUT,
    GRAD_READS_OUTPUT,
    GRAD_READS_SHAPES,
)
from fxpar.ir.program import Program

aten = torch.ops.aten

# what each op's backward reads: by op set or table of operand positions (fxpar.ir.op_classes.GRAD_READS_*)


@dataclass(frozen=True)
class Kept:
    """One tensor an op keeps for backward: ``key`` names its storage (or the op's own buffer)."""

    key: object
    nbytes: int
    producer: torch.fx.Node | None  # the node that made the storage (None: a user input)


def storage_key(val) -> object | None:
    """What identifies the memory a value lives in (its storage), or None for a non-tensor."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage of its own
        return ("value", id(val))


def _storage_bytes(val) -> int:
    try:
        return to_int(val.untyped_storage().nbytes())
    except Exception:  # a symbolic size without a hint: the value's own bytes, each unknown dim as 1
        return nbytes(val, missing=1) or 0


def _rows(val, normalized: int) -> int:
    return math.prod(to_int(s, missing=1) for s in val.shape[:val.dim() - normalized]) if val.dim() else 1


class SavedTensors:
    """For each node a gradient flows through, the tensors its backward reads (:meth:`of`).

    ``producer(key)`` is the first node whose value lives in that storage; parameters, buffers and
    constants are left out (they are held whether or not anything is saved)."""

    def __init__(self, program: Program):
        self.program = program
        self.flows = grad_flow(program, user_inputs=True, autograd=True)
        self.producer: dict[object, torch.fx.Node] = {}
        self.weights: set[object] = set()
        bound = {b.placeholder: b for b in program.inputs}
        for node in program.graph.nodes:
            key = storage_key(node.meta.get(meta.VAL))
            if key is None:
                continue
            if node.op == "get_attr" or (node.op == "placeholder" and bound[node.name].kind != "user"):
                self.weights.add(key)
            self.producer.setdefault(key, node)

    def value(self, node: torch.fx.Node) -> list[Kept]:
        val = node.meta.get(meta.VAL)
        key = storage_key(val)
        if key is None or key in self.weights:
            return []
        producer = self.producer.get(key)
        return [Kept(key, _storage_bytes(val), None if producer is None or producer.op == "placeholder" else producer)]

    def _operands(self, node: torch.fx.Node, positions) -> list[Kept]:
        out = []
        for i in positions:
            a = node.args[i] if i < len(node.args) else None
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(x, torch.fx.Node):
                    out += self.value(x)
        return out

    def _buffer(self, node: torch.fx.Node, nbytes_: int) -> list[Kept]:
        """A tensor the op makes for its own backward (a log-sum-exp, a norm's statistics)."""
        return [Kept(("buffer", node.name), nbytes_, node)] if nbytes_ else []

    def of(self, node: torch.fx.Node) -> list[Kept]:
        """The tensors ``node``'s backward reads; [] when no gradient flows through it."""
        if node.op != "call_function" or node not in self.flows:
            return []
        pkt = getattr(node.target, "overloadpacket", None)
        if pkt is None or str(pkt).startswith("fxpar."):  # getitem, higher-order ops, collectives: nothing
            return []
        args = node.args
        if pkt in GRAD_READS_CROSS:
            i, j = GRAD_READS_CROSS[pkt]
            needs = [isinstance(args[k], torch.fx.Node) and args[k] in self.flows for k in (i, j)]
            return self._operands(node, [p for p, other in ((i, needs[1]), (j, needs[0])) if other])
        if pkt in GRAD_READS_SHAPES or pkt is operator.getitem:
            return []
        if pkt in GRAD_READS_OUTPUT:
            return self.value(node)
        if pkt in GRAD_READS_INPUT:
            return self._operands(node, [0])
        if pkt in GRAD_READS_INDEX:
            return self._operands(node, [GRAD_READS_INDEX[pkt]])
        return self._special(node, pkt)

    def _special(self, node: torch.fx.Node, pkt) -> list[Kept]:
        args, val = node.args, node.meta.get(meta.VAL)
        if pkt is aten.div:
            keep = [1] if isinstance(args[1], torch.fx.Node) else []
            if isinstance(args[1], torch.fx.Node) and args[1] in self.flows:
                keep.append(0)
            return self._operands(node, keep)
        if pkt is aten.scaled_dot_product_attention:
            mask = node.kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            q = args[0].meta.get(meta.VAL)
            lse = _rows(q, 1) * 4 if isinstance(q, torch.Tensor) else 0
            kept = self._operands(node, [0, 1, 2]) + self.value(node) + self._buffer(node, lse)
            m = mask.meta.get(meta.VAL) if isinstance(mask, torch.fx.Node) else None
            if isinstance(m, torch.Tensor) and m.dtype == torch.bool:  # made a float bias by each call
                return kept + [Kept(("mask", node.name), (nbytes(m, missing=1) or 0) * q.element_size(), node)]
            return kept + (self.value(mask) if isinstance(mask, torch.fx.Node) else [])
        if pkt in (aten.layer_norm, aten.rms_norm, aten.group_norm):
            x = args[0].meta.get(meta.VAL)
            shape = args[1] if len(args) > 1 else ()
            stats = _rows(x, len(shape)) * 4 * (2 if pkt is not aten.rms_norm else 1) if isinstance(x, torch.Tensor) \
                else 0
            return self._operands(node, [0]) + self._buffer(node, stats)
        if pkt is aten.cross_entropy_loss:
            x = args[0].meta.get(meta.VAL)
            # the log-softmax of the logits, and the loss's total weight (a scalar)
            return self._operands(node, [1]) + self._buffer(node, (nbytes(x, missing=1) or 0) + 4)
        if pkt in (aten.dropout, aten.native_dropout, aten.feature_dropout):
            p, train = (args[1] if len(args) > 1 else 0.5), (args[2] if len(args) > 2 else True)
            return self._buffer(node, (nbytes(val, missing=1) or 0) // max(val.element_size(), 1)) \
                if train and p and isinstance(val, torch.Tensor) else []
        # an op this table does not know: every tensor operand kept
        return self._operands(node, range(len(args)))
