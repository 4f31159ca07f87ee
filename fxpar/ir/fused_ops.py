"""Schemas of fxpar's fused compute ops (``torch.ops.fxpar_kernels.*``): what passes emit into graphs.

Reads: nothing. Writes: the ops' schemas, fake kernels and autograd formulas (importing this module
registers them). Their real kernels are the runtime's (``fxpar.runtime.kernels``, a torch path on every
device and a Triton path on CUDA); as with the collectives of :mod:`fxpar.ir.ops`, a pass may emit
these ops without importing the runtime, and a process that runs them imports it.

* ``linear_cross_entropy(hidden [..., H], weight [Vs, H], labels [...], vocab_start, group, ignore_index,
  chunk, reduce_grad_hidden) -> (loss [...], lse [...])`` (the tokens ``...`` in any leading shape): the
  cross-entropy of ``hidden @ weight.T`` over the whole vocabulary, ``weight`` being this rank's rows
  ``vocab_start ..`` of a head split over ``group`` (None: one rank holds it all); the logits are never held whole
  (chunked over tokens, the max / sum-exp reductions over ``group`` inside). ``loss`` is 0 where the label is
  ``ignore_index``.
  Backward: ``linear_cross_entropy_backward`` (recomputes each chunk's logits), giving ``dhidden`` and
  ``dweight`` (``[0, H]`` when ``weight_grad`` is False: a frozen head, a LoRA's, has no gradient to make,
  neither its matmul per chunk nor the fp32 buffer the size of the head); ``dhidden`` is all-reduced over
  ``group`` inside when ``reduce_grad_hidden``, else left a partial sum for the graph's own reduction (the TP
  pass gives the hidden state Megatron's f).
"""

from __future__ import annotations

import torch

from fxpar.ir.errors import FxparError

__all__ = ["FUSED_OPS", "check_linear_cross_entropy", "linear_cross_entropy", "linear_cross_entropy_backward"]


def _no_kernel(op: str) -> tuple[torch.Tensor, torch.Tensor]:
    raise FxparError(f"fxpar_kernels.{op}: no kernel is registered for real tensors in this process; "
                     "importing fxpar.runtime.kernels.cross_entropy registers it")


def check_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    """Shapes of a fused loss call: hidden [..., H], weight [V, H], labels [...]."""
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise FxparError(f"linear_cross_entropy: hidden [..., H] and weight [V, H] expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise FxparError(f"linear_cross_entropy: labels of shape {tuple(hidden.shape[:-1])} expected, "
                         f"got {tuple(labels.shape)}")


@torch.library.custom_op("fxpar_kernels::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                         group: str | None, ignore_index: int, chunk: int,
                         reduce_grad_hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _no_kernel("linear_cross_entropy")


@linear_cross_entropy.register_fake
def _forward_fake(hidden, weight, labels, vocab_start, group, ignore_index, chunk, reduce_grad_hidden):
    check_linear_cross_entropy(hidden, weight, labels)
    return (hidden.new_empty(hidden.shape[:-1], dtype=torch.float32),
            hidden.new_empty(hidden.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("fxpar_kernels::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                  lse: torch.Tensor, grad_loss: torch.Tensor, grad_lse: torch.Tensor,
                                  vocab_start: int, group: str | None, ignore_index: int, chunk: int,
                                  reduce_grad_hidden: bool,
                                  weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _no_kernel("linear_cross_entropy_backward")


@linear_cross_entropy_backward.register_fake
def _backward_fake(hidden, weight, labels, lse, grad_loss, grad_lse, vocab_start, group, ignore_index, chunk,
                   reduce_grad_hidden, weight_grad=True):
    return torch.empty_like(hidden), torch.empty_like(weight) if weight_grad else weight.new_empty(0, weight.shape[1])


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, *rest = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.rest = tuple(rest)


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    weight_grad = ctx.needs_input_grad[1]
    dh, dw = linear_cross_entropy_backward(hidden, weight, labels, lse, grad_loss, grad_lse, *ctx.rest, weight_grad)
    return dh, dw if weight_grad else None, None, None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)

# Under autocast the op computes as the unfused head does (its matmuls in bf16, the loss in fp32):
# without this, a custom op sees fp32 inputs and the fused loss would differ from the unfused one by
# bf16 rounding. fxpar's mixed precision is bf16 only (``Plan.mixed_precision``).
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("fxpar_kernels::linear_cross_entropy", _device, torch.bfloat16)

# every fused op overload passes may emit (inspection lists the ones a graph uses)
FUSED_OPS = {
    "linear_cross_entropy": torch.ops.fxpar_kernels.linear_cross_entropy.default,
    "linear_cross_entropy_backward": torch.ops.fxpar_kernels.linear_cross_entropy_backward.default,
}
