"""Per-node cost estimates: forward and backward FLOPs, bytes read and written.

Reads node ``val`` (FakeTensors); writes ``fxpar.cost`` (:class:`~fxpar.ir.meta.NodeCost`) on every
node of the program, subgraphs of higher-order ops included (the higher-order-op node itself costs 0
so nothing is counted twice).

Matmul-like ops use torch's own formulas (``torch.utils.flop_counter``) where it registers the op. The
graph is pre-dispatch ATen, so the composite ops that matter most (``aten.linear``, ``aten.matmul``,
``aten.scaled_dot_product_attention``) are not in torch's registry, which only knows the ops they
decompose into; they are mapped to those formulas here. Everything else with a floating output is
counted as one FLOP per output element (elementwise and reductions), and view/metadata ops as free.

Attention is priced here for any query/key head dim ``d_qk`` and value head dim ``d_v`` (multi-head
latent attention has ``d_v != d_qk``; torch's formulas assume they are equal), grouped-query shapes and
3-D inputs (:func:`sdpa_flops`, :func:`sdpa_backward_flops`; equal to torch's where ``d_v == d_qk``).

Backward: 2x forward for matmuls (grad of input and of weight), the flash-style SDPA backward for
attention, 1x for the rest; 0 for nodes no gradient flows through (nothing they read depends on a
parameter that requires grad) and for nodes inside a ``set_grad_enabled(False)`` region.

Pricing never breaks a trace: a node whose pricing raises is counted as elementwise (one FLOP per
output element, backward as much again where a gradient flows) and a :class:`CostModelWarning` naming
the op and the reason is issued once per op and process.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils import flop_counter as fc

from fxpar.ir import fused_ops, meta
from fxpar.ir.analysis import grad_sources
from fxpar.ir.meta import NodeCost
from fxpar.ir.numeric import nbytes, to_int
from fxpar.ir.op_classes import LOGITS_BUFFERED, MOVE_OPS, READ_BOUND, VIEW_OPS
from fxpar.ir.ops import collective_kind
from fxpar.ir.program import Program, subgraphs_of

aten = torch.ops.aten
_FUSED_LOSS = fused_ops.FUSED_OPS["linear_cross_entropy"].overloadpacket

# Fused attention ops; each takes (query, key, value, ...) first. The pre-dispatch graph has the first;
# the others appear where a graph was captured lower down.
SDPA_OPS = frozenset(p for p in (getattr(aten, n, None) for n in (
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable")) if p is not None)


class CostModelWarning(UserWarning):
    """An op the cost model could not price; it was counted as elementwise instead."""


_WARNED: set[str] = set()  # ops already warned about in this process


def _shape(t) -> tuple[int, ...]:
    return tuple(to_int(s, missing=1) for s in t.shape)  # an estimate: a size without a hint counts 1


def _numel(t) -> int:
    return math.prod(_shape(t))


def _nbytes(t) -> int:
    return nbytes(t, missing=1)


def _tensors(x) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]


def _arg_vals(node: torch.fx.Node):
    def val(a):
        return a.meta.get(meta.VAL) if isinstance(a, torch.fx.Node) else a
    return pytree.tree_map(val, (node.args, node.kwargs))


def _packet(target):
    return getattr(target, "overloadpacket", None)


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """FLOPs of torch.matmul on shapes a and b (broadcast batch dims)."""
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    m, k = a[-2], a[-1]
    n = b[-1]
    batch = torch.broadcast_shapes(a[:-2], b[:-2])
    return math.prod(batch) * fc.mm_flop((m, k), (k, n))


def _sdpa_dims(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(score matrices, s_q, s_k, d_qk, d_v) of attention on q [..., s_q, d_qk], k [..., s_k, d_qk] and
    v [..., s_k, d_v]. The leading dims broadcast, and key/value may have fewer heads than the query
    (grouped-query attention: each key/value head serves several query heads), so every leading dim
    counts at the largest of its three sizes: one score matrix per query head and batch element."""
    if min(len(q), len(k), len(v)) < 2 or q[-1] != k[-1] or k[-2] != v[-2]:
        raise ValueError(f"attention shapes do not fit: q={q}, k={k}, v={v}")
    n = max(len(q), len(k), len(v)) - 2
    lead = [max((t[-3 - i] if len(t) - 2 > i else 1) for t in (q, k, v)) for i in range(n)]
    return math.prod(lead), q[-2], k[-2], q[-1], v[-1]


def sdpa_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> int:
    """Forward FLOPs of attention: S = Q K^T (2 s_q s_k d_qk per score matrix) and O = P V
    (2 s_q s_k d_v); softmax, scale and mask are not counted (as torch.utils.flop_counter)."""
    n, s_q, s_k, d_qk, d_v = _sdpa_dims(q, k, v)
    return 2 * n * s_q * s_k * (d_qk + d_v)


def sdpa_backward_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> int:
    """Backward FLOPs of attention as a flash kernel runs it, per score matrix (dO is [s_q, d_v]):
    recompute S = Q K^T (2 s_q s_k d_qk), dP = dO V^T (2 s_q s_k d_v), dV = P^T dO (2 s_k s_q d_v),
    dQ = dS K (2 s_q s_k d_qk), dK = dS^T Q (2 s_k s_q d_qk): 2 s_q s_k (3 d_qk + 2 d_v) in all.
    Where d_v == d_qk this is torch.utils.flop_counter.sdpa_backward_flop_count; an eager (math) backward
    does the same minus the recomputed S."""
    n, s_q, s_k, d_qk, d_v = _sdpa_dims(q, k, v)
    return 2 * n * s_q * s_k * (3 * d_qk + 2 * d_v)


def _forward_flops(node: torch.fx.Node, args, kwargs, out) -> tuple[int, str]:
    """(forward FLOPs, kind); kind is 'matmul', 'attention', 'view', 'move' or 'elementwise'."""
    pkt = _packet(node.target)
    if pkt in VIEW_OPS:
        return 0, "view"
    if pkt in MOVE_OPS or collective_kind(node) is not None:  # fxpar's collectives move bytes, compute nothing
        return 0, "move"
    if pkt is aten.linear:
        x, w = _shape(args[0]), _shape(args[1])
        m = math.prod(x[:-1])
        flops = fc.mm_flop((m, x[-1]), (w[1], w[0]))
        if len(args) > 2 and args[2] is not None:
            flops += m * w[0]
        return flops, "matmul"
    if pkt is aten.matmul:
        return _matmul_flops(_shape(args[0]), _shape(args[1])), "matmul"
    if pkt in SDPA_OPS:
        return sdpa_flops(*(_shape(t) for t in args[:3])), "attention"
    if pkt is _FUSED_LOSS:  # the head's matmul (its elementwise work is small beside it)
        x, w = _shape(args[0]), _shape(args[1])
        return fc.mm_flop((math.prod(x[:-1]), x[-1]), (w[1], w[0])), "fused_loss"
    grouped = _grouped_mm_flops(args, out)
    if grouped:
        return grouped, "matmul"
    if pkt is not None and pkt in fc.flop_registry:  # a formula that raises goes to the fallback
        return int(fc.flop_registry[pkt](*args, out_val=out, **kwargs)), "matmul"
    if pkt in READ_BOUND:  # one FLOP per input element: a loss over 4096-word logits is not one scalar's work
        return _elementwise_flops((args, kwargs, out))
    return _elementwise_flops(out)


def _grouped_mm_flops(args, out) -> int:
    """A grouped (per-expert) matmul, recognised by its shapes whatever op carries it (``aten._grouped_mm``,
    transformers' ``grouped_mm_fallback`` custom op, ...): rows ``x [S, K]`` sorted by expert, 3-D weights
    ``[E, K, N]`` (or ``[E, N, K]``), output ``[S, N]``. Each row meets one expert: ``2 * S * K * N``.
    torch's flop registry knows none of these ops; one FLOP per output element would undercount the experts
    by a factor of 2K. 0 where the shapes do not match."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    outs = _tensors(out)
    if len(tensors) < 2 or len(outs) != 1:
        return 0
    x, w, y = _shape(tensors[0]), _shape(tensors[1]), _shape(outs[0])
    if len(x) != 2 or len(w) != 3 or len(y) != 2 or y[0] != x[0]:
        return 0
    k, n = x[1], y[1]
    if (w[1], w[2]) not in ((k, n), (n, k)):
        return 0
    return 2 * x[0] * k * n


def _elementwise_flops(out) -> tuple[int, str]:
    outs = [t for t in _tensors(out) if t.is_floating_point()]
    if not outs:
        return 0, "view"
    return max(_numel(t) for t in outs), "elementwise"


def _backward_flops(kind: str, fwd: int, args) -> int:
    if kind == "fused_loss":  # the logits recomputed, then dh and dW: three matmuls
        return 3 * fwd
    if kind == "matmul":
        return 2 * fwd
    if kind == "attention":
        return sdpa_backward_flops(*(_shape(t) for t in args[:3]))
    return fwd if kind == "elementwise" else 0


def _node_cost(node: torch.fx.Node, needs_grad: bool) -> NodeCost:
    if node.op != "call_function" or isinstance(node.target, torch._ops.HigherOrderOperator):
        return meta.ZERO_COST
    try:
        return _priced(node, needs_grad)
    except Exception as e:  # never break a trace on pricing: estimate, and say so once per op
        op = str(node.target)
        if op not in _WARNED:
            _WARNED.add(op)
            warnings.warn(f"fxpar cost model: cannot price {op} (node {node.name}: {type(e).__name__}: {e}); "
                          "counted as elementwise, one FLOP per output element", CostModelWarning, stacklevel=2)
        return _fallback_cost(node, needs_grad)


def _fallback_cost(node: torch.fx.Node, needs_grad: bool) -> NodeCost:
    try:
        out = node.meta.get(meta.VAL)
        fwd, kind = _elementwise_flops(out)
        written = sum(_nbytes(t) for t in _tensors(out))
    except Exception:  # not even the output is readable: count nothing
        return meta.ZERO_COST
    return NodeCost(fwd, fwd if needs_grad and kind == "elementwise" else 0, 0, written)


def _priced(node: torch.fx.Node, needs_grad: bool) -> NodeCost:
    args, kwargs = _arg_vals(node)
    out = node.meta.get(meta.VAL)
    fwd, kind = _forward_flops(node, args, kwargs, out)
    if kind == "view":
        return NodeCost(fwd, 0, 0, 0)
    read = sum(_nbytes(t) for t in _tensors((args, kwargs)))
    written = sum(_nbytes(t) for t in _tensors(out))
    if _packet(node.target) in LOGITS_BUFFERED:  # its log-softmax buffer, the size of the logits
        written += _nbytes(_tensors(args)[0])
    bwd = _backward_flops(kind, fwd, args) if needs_grad else 0
    return NodeCost(fwd, bwd, read, written)


def _grad_enabled_region(node: torch.fx.Node) -> bool | None:
    """For ``wrap_with_set_grad_enabled(enabled, body, ...)``: the mode it sets; None for other nodes."""
    if getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" or \
            str(node.target).endswith("wrap_with_set_grad_enabled"):
        return bool(node.args[0])
    return None


def _annotate(gm: torch.fx.GraphModule, grad_inputs: set[str] | None, grad_enabled: bool) -> NodeCost:
    """Annotate gm's nodes; ``grad_inputs`` names placeholders a gradient flows to (None = all)."""
    total = meta.ZERO_COST
    flows: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if grad_inputs is None or node.name in grad_inputs:
                flows.add(node)
            node.meta[meta.COST] = meta.ZERO_COST
            continue
        needs = grad_enabled and any(a in flows for a in node.all_input_nodes)
        if needs:
            flows.add(node)
        cost = _node_cost(node, needs)
        node.meta[meta.COST] = cost
        total = total + cost
        region = _grad_enabled_region(node)
        for sub in subgraphs_of(gm, node):
            enabled = grad_enabled if region is None else (grad_enabled and region)
            total = total + _annotate(sub, None if needs else set(), enabled)
    return total


def annotate_costs(program: Program) -> NodeCost:
    """Write ``fxpar.cost`` on every node of ``program``; return the whole forward+backward estimate."""
    # float user inputs may require grad too (e.g. inputs_embeds)
    return _annotate(program.gm, grad_sources(program, user_inputs=True), True)
