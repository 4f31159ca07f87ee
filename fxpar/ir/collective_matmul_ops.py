"""Schemas of the collective matmuls (``torch.ops.fxpar_kernels.*``) that sequence-parallel TP emits.

Reads: nothing at import but torch and :mod:`fxpar.ir.ops`. Writes: the ops' schemas, fake kernels and
autograd formulas (importing this module registers them). The real kernels are
:mod:`fxpar.runtime.kernels.collective_matmul` (the design notes are there); as with :mod:`fxpar.ir.ops`,
passes emit these ops without importing the runtime.

* ``all_gather_linear(x, group, dim, chunks, weights, biases, has_bias) -> [gathered, y_0, ...]``:
  ``fxpar.all_gather_rs_bwd(x, group, dim)`` and ``aten.linear(gathered, W_k, b_k)`` for each weight, in
  ``chunks`` pieces whose communication overlaps the previous piece's matmul. ``biases`` holds the
  biases of the weights whose ``has_bias`` is true (a list of optional tensors cannot carry autograd
  through ``custom_op``). Backward: ``all_gather_linear_backward`` (chunked matmul -> reduce-scatter).
* ``linear_reduce_scatter(x, group, dim, chunks, weight, bias) -> y``: ``fxpar.reduce_scatter(linear(x))``
  likewise. Backward: ``linear_reduce_scatter_backward`` (chunked all-gather -> matmul).

Counted as the collective each replaces (``fxpar.ir.ops.FUSED_COLLECTIVES``), so inspection and the
byte counters see the same communication as without chunking.
"""

from __future__ import annotations

import torch

from fxpar.ir.errors import CollectiveError
from fxpar.ir.ops import check_dim, group_size, shard_len

__all__ = ["PAYLOAD", "all_gather_linear", "all_gather_linear_backward", "check_chunks", "check_token_dim",
           "compute_dtype",
           "linear_reduce_scatter", "linear_reduce_scatter_backward"]

# node meta: bytes of the full tensor the fused collective moves (a reduce-scatter's input is no
# argument of linear_reduce_scatter, so fxpar.cost.comm cannot read it off the node's arguments)
PAYLOAD = "fxpar.collective_payload"


def _no_kernel(op: str, group: str):
    raise CollectiveError("no kernel is registered for real tensors in this process; importing "
                          "fxpar.runtime.kernels.collective_matmul registers it", op=op, group=group)


def check_chunks(op: str, group: str, shape, dim: int, chunks: int, gathered: bool) -> int:
    """Tokens per chunk of each rank's shard along ``dim`` (``shape``: the local input of a gather, the
    full input of a reduce-scatter); raises, before any communication, where ``chunks`` does not divide
    the shard."""
    n = group_size(group)
    local = shape[dim] if gathered else shape[dim] // n
    if chunks < 1 or local % chunks:
        fits = [c for c in range(2, local + 1) if local % c == 0]
        raise CollectiveError(
            f"each rank's sequence shard has {local} tokens along dim {dim} (input shape {tuple(shape)}, group "
            f"size {n}), which do not split into {chunks} chunks; set Plan.collective_matmul to one of {fits} "
            f"(a divisor of {local}), or to 0 to turn it off", op=op, group=group, sizes=[tuple(shape)])
    return local // chunks


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``aten.linear`` computes ``x`` in here: autocast's (bf16 mixed precision) for fp32
    inputs while it is on, else ``x``'s own. The kernels cast as autocast would, so the chunked path
    gathers and multiplies in the same dtypes as the unchunked one."""
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def check_token_dim(op: str, group: str, x: torch.Tensor, dim: int) -> int:
    """``dim`` normalised; it must not be the features dim the linear reduces."""
    d = check_dim(op, group, x, dim)
    if d == x.dim() - 1:
        raise CollectiveError(f"dim {dim} is the features dim the linear multiplies; the collective matmul "
                              "splits a token dim", op=op, group=group, sizes=[tuple(x.shape)])
    return d


# ---------------------------------------------------------------------------------------------------
# all-gather -> linear


@torch.library.custom_op("fxpar_kernels::all_gather_linear", mutates_args=())
def all_gather_linear(x: torch.Tensor, group: str, dim: int, chunks: int, weights: list[torch.Tensor],
                      biases: list[torch.Tensor], has_bias: list[bool]) -> list[torch.Tensor]:
    return _no_kernel("all_gather_linear", group)


@all_gather_linear.register_fake
def _agl_fake(x, group, dim, chunks, weights, biases, has_bias):
    d = check_token_dim("all_gather_linear", group, x, dim)
    check_chunks("all_gather_linear", group, x.shape, d, chunks, gathered=True)
    shape = list(x.shape)
    shape[d] *= group_size(group)
    dt = compute_dtype(x)
    return [x.new_empty(shape)] + [x.new_empty((*shape[:-1], w.shape[0]), dtype=dt) for w in weights]


@torch.library.custom_op("fxpar_kernels::all_gather_linear_backward", mutates_args=())
def all_gather_linear_backward(grads: list[torch.Tensor], gathered: torch.Tensor, group: str, dim: int,
                               chunks: int, weights: list[torch.Tensor], has_bias: list[bool]) -> list[torch.Tensor]:
    """``grads``: of the gathered tensor, then of each output. Returns ``[dx, dW_0.., db_k (with bias)..]``."""
    return _no_kernel("all_gather_linear_backward", group)


@all_gather_linear_backward.register_fake
def _aglb_fake(grads, gathered, group, dim, chunks, weights, has_bias):
    op = "all_gather_linear_backward"
    d = check_dim(op, group, gathered, dim)
    shape = list(gathered.shape)
    shape[d] = shard_len(op, group, gathered, d, group_size(group))
    return ([gathered.new_empty(shape)] + [torch.empty_like(w) for w in weights]
            + [w.new_empty(w.shape[:1]) for w, h in zip(weights, has_bias) if h])


def _agl_setup(ctx, inputs, output):
    x, group, dim, chunks, weights, biases, has_bias = inputs
    ctx.save_for_backward(output[0], *weights)
    ctx.args, ctx.has_bias = (group, dim, chunks), list(has_bias)


def _agl_backward(ctx, grads):
    gathered, *weights = ctx.saved_tensors
    out = all_gather_linear_backward(list(grads), gathered, *ctx.args, weights, ctx.has_bias)
    m = len(weights)
    return out[0], None, None, None, out[1:1 + m], out[1 + m:], None


all_gather_linear.register_autograd(_agl_backward, setup_context=_agl_setup)


# ---------------------------------------------------------------------------------------------------
# linear -> reduce-scatter


@torch.library.custom_op("fxpar_kernels::linear_reduce_scatter", mutates_args=())
def linear_reduce_scatter(x: torch.Tensor, group: str, dim: int, chunks: int, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    return _no_kernel("linear_reduce_scatter", group)


@linear_reduce_scatter.register_fake
def _lrs_fake(x, group, dim, chunks, weight, bias):
    op = "linear_reduce_scatter"
    d = check_token_dim(op, group, x, dim)
    check_chunks(op, group, x.shape, d, chunks, gathered=False)
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[d] = shard_len(op, group, x, d, group_size(group))
    return x.new_empty(shape, dtype=compute_dtype(x))


@torch.library.custom_op("fxpar_kernels::linear_reduce_scatter_backward", mutates_args=())
def linear_reduce_scatter_backward(grad: torch.Tensor, x: torch.Tensor, group: str, dim: int, chunks: int,
                                   weight: torch.Tensor, has_bias: bool) -> list[torch.Tensor]:
    """Returns ``[dx, dW]`` (+ ``[db]`` with a bias)."""
    return _no_kernel("linear_reduce_scatter_backward", group)


@linear_reduce_scatter_backward.register_fake
def _lrsb_fake(grad, x, group, dim, chunks, weight, has_bias):
    return [torch.empty_like(x), torch.empty_like(weight)] + ([weight.new_empty(weight.shape[:1])] if has_bias else [])


def _lrs_setup(ctx, inputs, output):
    x, group, dim, chunks, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.args, ctx.has_bias = (group, dim, chunks), bias is not None


def _lrs_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    out = linear_reduce_scatter_backward(grad, x, *ctx.args, weight, ctx.has_bias)
    return out[0], None, None, None, out[1], (out[2] if ctx.has_bias else None)


linear_reduce_scatter.register_autograd(_lrs_backward, setup_context=_lrs_setup)
