"""Classes of ATen ops, defined once for the cost model and the passes (keyed by ``OpOverloadPacket``).

Each set is named for what its consumer relies on, so two consumers that need different lines draw
them apart here rather than in private copies:

* :data:`VIEW_OPS`, :data:`MOVE_OPS`: the cost model's free ops (views, metadata, no arithmetic) and
  data movement (bytes, no FLOPs);
* :data:`RESHAPES`, :data:`PASS_THROUGH`, :data:`SPLITS`, :data:`REDUCTIONS`, :data:`SOFTMAX`,
  :data:`LINEAR_UNARY`, :data:`ASSERTS`: what the tensor-parallel pass reasons about (a layout flows
  through them, or they are linear in their operand); :data:`DIM_MOVES`, :data:`DIM_MOVES_AND_CUTS`,
  :data:`NORMS`, :data:`BATCHED_MATMULS`, :data:`ATTENTION_PRODUCTS`, :data:`CACHE_WRITES`,
  :data:`LOSSES`, :data:`COLUMN_CARRIERS`, :data:`TOKEN_GATHERS`, :data:`VIEWS_AND_CASTS`: what its
  analyses walk through;
* :data:`MATMUL_LIKE`, :data:`GRAD_READS_OUTPUT`, :data:`GRAD_READS_INPUT`, :data:`GRAD_READS_SHAPES`:
  what autograd keeps for backward (``fxpar.cost.saved``); :data:`MATMUL_KERNELS`,
  :data:`PRODUCT_KERNELS`: the products seen at dispatch (selective recompute, the profiled reference
  step);
* :data:`ORDER_KEEPING` (by ``OpOverload``): what the fused loss looks through;
  :data:`WEIGHT_VIEWS`, :func:`expert_matmuls`: what expert parallelism finds its regions by;
* :func:`is_pointwise`, :func:`is_grouped_mm`: predicates on a node.

A line here is a rule a consumer depends on. Sets that look alike (``DIM_MOVES`` and
``DIM_MOVES_AND_CUTS``, ``BATCHED_MATMULS`` and ``ATTENTION_PRODUCTS``, ``MATMUL_KERNELS`` and
``PRODUCT_KERNELS``, ``VIEWS_AND_CASTS`` and ``WEIGHT_VIEWS``, ``GROUPED_MM`` and
:data:`EXPERT_MATMUL_NAMES`) keep the members their consumers had before they were gathered here;
merging two changes what a pass does, and wants a test of both consumers. ``tests/test_op_sets.py``
fails on a module-level op set declared anywhere else.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir.collectives import COLLECTIVES

aten = torch.ops.aten

# views, metadata and no-copy ops: no FLOPs and no bytes moved (fxpar.cost.flops)
VIEW_OPS = frozenset({
    aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.slice, aten.select, aten.transpose,
    aten.t, aten.permute, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach, aten.as_strided,
    aten.unflatten, aten.flatten, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.narrow,
    aten.contiguous, aten._assert_tensor_metadata, aten.lift_fresh_copy, aten.sym_size, aten.view_as,
    aten.expand_as, aten.movedim, aten.diagonal, aten.unfold,
})
# data movement and creation: no arithmetic, but bytes (fxpar.cost.flops)
MOVE_OPS = frozenset({
    aten.embedding, aten.index, aten.index_select, aten.gather, aten.cat, aten.stack, aten.clone, aten.copy,
    aten.copy_, aten._to_copy, aten.to, aten.pad, aten.constant_pad_nd, aten.new_ones, aten.new_zeros,
    aten.zeros, aten.ones, aten.full, aten.arange, aten.empty, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.scalar_tensor, aten.repeat, aten.repeat_interleave, aten.roll, aten.flip,
    aten.masked_fill, aten.where, aten.index_put, aten.scatter,
})

# reshapes by a size list: a shard of a merged dim moves to its leading factor
RESHAPES = frozenset({aten.view, aten.reshape, aten._unsafe_view})
# one input, same shape and dims out (copies, casts, dropout): any layout passes through unchanged
PASS_THROUGH = frozenset({aten.contiguous, aten.alias, aten.clone, aten.detach, aten.dropout, aten.to,
                          aten._to_copy, aten.lift_fresh_copy})
# checks with no output a later op reads: they neither use nor change a layout
ASSERTS = frozenset({aten._assert_tensor_metadata})
# cut a tensor into pieces along one dim (slice is a split with one piece, handled alongside)
SPLITS = frozenset({aten.chunk, aten.split, aten.split_with_sizes})
# argument names of the split-like ops (and slice), to read them whether given by position or by keyword
SPLIT_ARGS = {aten.chunk: ("self", "chunks", "dim"), aten.split: ("self", "split_size", "dim"),
              aten.split_with_sizes: ("self", "split_sizes", "dim"),
              aten.slice: ("self", "dim", "start", "end", "step")}
# convolutions: the groups argument's position (conv1d/conv2d(input, weight, bias, stride, padding, dilation,
# groups); convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups))
CONV_GROUPS_AT = {aten.conv1d: 6, aten.conv2d: 6, aten.convolution: 8}
REDUCTIONS = frozenset({aten.mean, aten.sum, aten.amax, aten.amin})
SOFTMAX = frozenset({aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax})
# copies and casts of one tensor (PASS_THROUGH but dropout, which is not linear and draws a mask)
COPIES_AND_CASTS = PASS_THROUGH - {aten.dropout}
# unary ops linear in their input (f(a + b) = f(a) + f(b)): a partial sum stays one through them
LINEAR_UNARY = RESHAPES | COPIES_AND_CASTS | {
    aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand, aten.sum, aten.mean, aten.t}

# dims reordered or added, every input dim whole in the output (TP packing follows a packed dim through)
DIM_MOVES = frozenset({aten.transpose, aten.permute, aten.t, aten.numpy_T, aten.unsqueeze, aten.expand})
# also dims dropped, merged, narrowed or broadcast (TP inference follows a shard's dim through each)
DIM_MOVES_AND_CUTS = DIM_MOVES | {aten.squeeze, aten.broadcast_to, aten.flatten, aten.slice, aten.select}
# ops that only view or cast one tensor: a gradient summed before them is summed for them too (TP scans)
VIEWS_AND_CASTS = COPIES_AND_CASTS | {aten.select, aten.unsqueeze, aten.transpose, aten.squeeze, aten.view,
                                      aten.reshape, aten.permute, aten.slice, aten.expand}
# normalizations over trailing dims (layer / RMS norm) or channel groups (group norm)
NORMS = frozenset({aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten.group_norm, aten.native_group_norm})
# products batched over leading dims (TP inference: a shard on a batch dim stays there)
BATCHED_MATMULS = frozenset({aten.matmul, aten.bmm})
# attention and the batched products it is written with (TP packing: a head dim passes through them)
ATTENTION_PRODUCTS = BATCHED_MATMULS | {aten.scaled_dot_product_attention, aten.baddbmm}
# keys/values written into a KV cache, read by attention
CACHE_WRITES = frozenset({aten.index_copy_, aten.index_copy})
LOSSES = frozenset({aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d})
# ops a column-parallel output flows through on its way to the next linear (TP's carriers walk)
COLUMN_CARRIERS = frozenset({
    aten.view, aten.reshape, aten._unsafe_view, aten.transpose, aten.permute, aten.unsqueeze, aten.contiguous,
    aten.alias, aten.clone, aten.to, aten._to_copy, aten.dropout, aten.expand, aten.scaled_dot_product_attention,
    aten.matmul, aten.softmax, aten._softmax, aten.chunk, aten.split, aten.split_with_sizes, aten.slice, aten.index,
    aten.cat, aten.flatten, aten.broadcast_to, aten.squeeze,
    # state-space scans: per-channel convolutions, steps of the recurrence picked and stacked
    aten.conv1d, aten.convolution, aten.select, aten.stack, aten.cumsum, aten.einsum, aten.pad,
    aten.repeat_interleave, aten.zeros_like, aten.tril,
    aten.mean, aten.sum,  # a gated RMS norm over the channels (a partial sum of squares)
})
# ops that gather the tokens each expert reads (pure, replicated in, replicated out)
TOKEN_GATHERS = COPIES_AND_CASTS | {aten.index, aten.repeat_interleave, aten.unsqueeze}

# matrix products and attention, as traced (linear, matmul) and as dispatched (mm, bmm, ...): the ops
# whose outputs selective recompute keeps (fxpar.cost.saved / activations)
MATMUL_LIKE = frozenset({aten.linear, aten.matmul, aten.mm, aten.bmm, aten.addmm, aten.baddbmm,
                         aten.scaled_dot_product_attention})
# the backward reads the op's output
GRAD_READS_OUTPUT = frozenset({aten.rsqrt, aten.sqrt, aten.exp, aten.tanh, aten.sigmoid, aten.relu, aten.softmax,
                               aten._softmax, aten.log_softmax, aten._log_softmax, aten.reciprocal})
# the backward reads the first operand
GRAD_READS_INPUT = frozenset({aten.pow, aten.silu, aten.gelu, aten.log, aten.log1p, aten.sin, aten.cos, aten.erf,
                              aten.abs, aten.softplus, aten.leaky_relu, aten.mish, aten.elu, aten.hardtanh,
                              aten.square, aten.amax, aten.amin})
# the backward reads each of two operands when the other needs a gradient (the product rule): their positions
GRAD_READS_CROSS = {aten.linear: (0, 1), aten.matmul: (0, 1), aten.mm: (0, 1), aten.bmm: (0, 1), aten.mul: (0, 1),
                    aten.addmm: (1, 2), aten.baddbmm: (1, 2)}
# the backward reads an index or mask operand: its position
GRAD_READS_INDEX = {aten.embedding: 1, aten.index: 1, aten.gather: 2, aten.index_select: 2, aten.where: 0,
                    aten.masked_fill: 1, aten.scatter: 2, aten.nll_loss: 1, aten.nll_loss_nd: 1}
# the backward needs shapes only
GRAD_READS_SHAPES = VIEW_OPS | frozenset({
    aten.add, aten.sub, aten.rsub, aten.neg, aten.cat, aten.stack, aten.sum, aten.mean, aten.clone,
    aten._to_copy, aten.to, aten.copy, aten.copy_, aten.alias, aten.detach, aten.pad, aten.constant_pad_nd,
    aten.repeat, aten.tril, aten.triu, aten.flip, aten.roll, aten.zeros_like, aten.ones_like, aten.full_like,
})
# the dense products aten.linear and aten.matmul reach at dispatch (what a profiler or a dispatch-time
# policy sees; the profiled reference step counts these)
MATMUL_KERNELS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
# every dispatched product whose output selective recompute keeps: also convolutions and scaled (fp8) matmuls
PRODUCT_KERNELS = MATMUL_KERNELS | {aten.convolution, aten._scaled_mm}

# by OpOverload: ops whose output holds its input's elements in the same order (reshapes, copies, casts),
# so rows of logits before them are rows after them (the fused loss looks through a chain of them)
ORDER_KEEPING = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype,
                           aten._to_copy.default, aten.contiguous.default, aten.clone.default, aten.alias.default})

# names of grouped (per-expert) matmul ops in any namespace, whichever library defines them (TP's rules)
GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")
# the grouped matmuls expert parallelism cuts, by qualified name (see :func:`expert_matmuls`)
EXPERT_MATMUL_NAMES = ("transformers::grouped_mm_fallback", "aten::_grouped_mm")
# what an expert weight is read through on its way to a grouped matmul (views, transposes, casts)
WEIGHT_VIEWS = frozenset({aten.transpose, aten.permute, aten.view, aten.reshape, aten._to_copy, aten.to,
                          aten.contiguous, aten.alias, aten.t, aten.expand})


# Context parallelism (fxpar.passes.cp_ops) follows the sequence dim through these:
# same elements in the same order under another shape (the dim found again by element arithmetic)
SAME_ORDER_RESHAPES = RESHAPES | {aten.flatten, aten.unsqueeze, aten.squeeze}
# whose second argument is the output's shape
SHAPE_ARG_OPS = RESHAPES | {aten.expand}
# elementwise in effect, broadcasting like pointwise ops
ELEMENTWISE_LIKE = PASS_THROUGH | {aten.type_as, aten.masked_fill, aten.where, aten.zeros_like, aten.ones_like,
                                   aten.empty_like, aten.full_like}
# a new tensor whose shape comes from the arguments, not the input's
NEW_TENSOR_FACTORIES = frozenset({aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full})
# products of two activations (attention's scores and their product with the values), or of an activation
ACTIVATION_PRODUCTS = BATCHED_MATMULS | {aten.mm, aten.baddbmm}
# layout and dtype only: what lies between a key/value projection and attention (the grouped-query expansion)
LAYOUT_CHAIN = SAME_ORDER_RESHAPES | PASS_THROUGH | {aten.expand, aten.transpose, aten.permute}
# normalisations over the last dims (their second argument: the normalized shape)
LAST_DIM_NORMS = frozenset({aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm})
# reductions and scans along the dims their second argument names
DIM_REDUCTIONS = REDUCTIONS | SOFTMAX | {aten.var, aten.std, aten.cumsum, aten.argmax, aten.any, aten.all}
# losses that take a log-softmax of their logits into a buffer of their size before they pick one per row
LOGITS_BUFFERED = frozenset({aten.cross_entropy_loss})
# ops whose work is over their input, not their (smaller) output: reductions, and those losses
READ_BOUND = REDUCTIONS | LOGITS_BUFFERED | {aten.var, aten.std, aten.logsumexp}
# views that keep, move or cut dims
DIM_VIEWS = SAME_ORDER_RESHAPES | SHAPE_ARG_OPS | {aten.transpose, aten.permute, aten.t, aten.slice, aten.select}
# new tensors of another tensor's shape (its values unread)
SHAPED_LIKE = frozenset({aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like})
# ops that select, order or expand along one dim, each row of the others on its own (top-k routing)
ALONG_ONE_DIM = frozenset({aten.topk, aten.sort, aten.argsort, aten.max, aten.min, aten.one_hot})
# reads and writes at an index tensor's positions along one dim
TAKES_AND_PUTS = frozenset({aten.gather, aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_})


def resolve_ops(names) -> frozenset:
    """The ``OpOverloadPacket`` of each qualified op name (``"aten::_grouped_mm"``) registered in this
    process; a name that is not (an op this torch lacks, a library's op whose module is not imported) is
    left out."""
    out = set()
    for name in names:
        ns, _, op = name.partition("::")
        try:
            out.add(getattr(getattr(torch.ops, ns), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(out)


def expert_matmuls() -> frozenset:
    """:data:`EXPERT_MATMUL_NAMES` resolved now: transformers registers its op when its MoE module is
    imported, which may come after this module's import, and always before a graph holding the op exists."""
    return resolve_ops(EXPERT_MATMUL_NAMES)


def packet(node: torch.fx.Node):
    """The node's ``OpOverloadPacket`` (``aten.view`` for ``aten.view.default``), or None."""
    return getattr(node.target, "overloadpacket", None)


def is_pointwise(node: torch.fx.Node) -> bool:
    """An elementwise op (torch's ``pointwise`` tag, or a user autograd.Function found elementwise when
    captured): each output element reads the same place of each input."""
    from fxpar.ir.function_op import call_of, is_function_node

    if is_function_node(node):
        return call_of(node.args[1]).elementwise
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def is_grouped_mm(node: torch.fx.Node) -> bool:
    """A grouped (per-expert) matmul ``x[T, K] @ w[E, K, N]``."""
    return node.op == "call_function" and getattr(packet(node), "__name__", "") in GROUPED_MM


def _op_name(func) -> tuple[str, str]:
    ns, _, op = (func.name() if hasattr(func, "name") else str(func)).partition("::")
    return ns, op.split(".")[0]


def selective_product(func) -> bool:
    """Whether ``func`` (an OpOverload, as traced or as dispatched) is a matrix product, an attention kernel or
    a collective matmul: the outputs selective recompute keeps for their cost to compute again."""
    pkt = getattr(func, "overloadpacket", None)
    if pkt in PRODUCT_KERNELS or pkt in MATMUL_LIKE:
        return True
    ns, op = _op_name(func)
    if "scaled_dot_product" in op or op.startswith(("_flash_attention", "_efficient_attention")):
        return True
    return ns == "fxpar_kernels" and op in ("all_gather_linear", "linear_reduce_scatter")


def kept_by_selective(func) -> bool:
    """Whether selective recompute keeps the output of ``func``: :func:`selective_product`, and fxpar's TP
    collectives (not ZeRO-3's parameter gathers), kept so that recomputation communicates nothing. The runtime's
    policy (``fxpar.passes.recompute``) reads it; the activation model (``fxpar.cost.activations``) counts the
    products' outputs."""
    if selective_product(func):
        return True
    ns, op = _op_name(func)  # an observed gather (ZeRO-3's) is regathered, not held (its record says so)
    return ns == "fxpar" and not getattr(COLLECTIVES.get(op), "observed", False)


def writes_first(node: torch.fx.Node) -> bool:
    """``node`` writes its first argument in place (``copy_``, ``add_``, ``index_put_``), by its schema."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write
