"""Single-process reference runs to check distributed training against.

:func:`grads_by_fqn` collects a model's gradients by parameter name, :func:`reference_step` runs one
forward + backward on a freshly built model, and :func:`train_against_reference` /
:func:`reference_trajectory` + :func:`compare_trajectory` train a compiled model next to a
single-process reference and report the worst loss and parameter differences. All of these are
re-exported by :mod:`fxpar.testing.compare`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "grads_by_fqn",
    "reference_step",
    "train_against_reference",
    "reference_trajectory",
    "compare_trajectory",
    "shard_grad_diff",
]


def grads_by_fqn(
    model: torch.nn.Module, *, full: bool = True, include_none: bool = False
) -> dict[str, torch.Tensor]:
    """``{parameter FQN: gradient}`` (detached clones) for the parameters that have one.

    ``full=True`` gathers ``DTensor`` gradients with ``full_tensor()`` (a collective).
    ``include_none=True`` also lists trainable parameters without a gradient, as ``None``.
    """
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            if include_none and p.requires_grad:
                out[name] = None
            continue
        if full:
            try:
                from torch.distributed.tensor import DTensor

                if isinstance(g, DTensor):
                    g = g.full_tensor()
            except ImportError:  # pragma: no cover
                pass
        out[name] = g.detach().clone()
    return out


def _default_loss(outputs: Any) -> torch.Tensor:
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        loss = outputs
    if loss is None:
        raise ValueError(
            "reference_step: the model output has no .loss (pass labels in inputs, or a loss_fn)"
        )
    return loss


def reference_step(
    model_factory: Callable[[], torch.nn.Module],
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    seed: int | None = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-process reference: build a model, run forward + backward, return (loss, grads).

    ``model_factory()`` builds the model (after ``torch.manual_seed(seed)`` unless ``seed``
    is None, so the distributed side can rebuild identical weights). ``inputs`` is a dict
    (``model(**inputs)``, Hugging Face style), a tuple/list (``model(*inputs)``) or a single
    tensor. The loss is ``loss_fn(outputs, inputs)`` if given, else ``outputs.loss`` (or the
    output itself if it is a scalar tensor). The model keeps the train/eval mode the
    factory gave it. Returns the detached loss and :func:`grads_by_fqn` of the model.
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = model_factory()
    if isinstance(inputs, Mapping):
        outputs = model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        outputs = model(*inputs)
    else:
        outputs = model(inputs)
    loss = loss_fn(outputs, inputs) if loss_fn is not None else _default_loss(outputs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"reference_step: the loss must be a scalar tensor, got {type(loss).__name__}")
    loss.backward()
    return loss.detach(), grads_by_fqn(model)


def train_against_reference(compiled, reference: torch.nn.Module, optimizer: Callable, batch: dict,
                            steps: int, *, grads: bool = False, every_step: bool = True) -> dict[str, float]:
    """``steps`` training steps of a compiled model next to a single-process ``reference`` (same initial
    weights) on the same batch; the worst loss difference and the worst parameter difference (the
    compiled model's gathered ``full_state_dict`` after every step), and with ``grads`` the worst
    difference of every gathered gradient (a parameter eager gives none compared with zeros, which is what
    ``full_state_dict(grads=True)`` holds for it). ``every_step=False`` compares the parameters after the last
    step only (with ``grads``, every step's gradients already pin each update down)."""
    ref_opt = optimizer(reference.parameters())
    out = {"loss": 0.0, "weights": 0.0, **({"grad": 0.0} if grads else {})}
    for i in range(steps):
        loss = compiled.step(**batch)
        ref_opt.zero_grad()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        if grads:
            got = compiled.full_state_dict(grads=True)
            for k, p in reference.named_parameters(remove_duplicate=False):  # no gradient: zeros, as got's
                want = p.grad if p.grad is not None else torch.zeros_like(p)
                out["grad"] = max(out["grad"], (got[k] - want).abs().max().item())
        ref_opt.step()
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        if not every_step and i < steps - 1:
            continue
        state = compiled.full_state_dict()
        out["weights"] = max(out["weights"], max((state[k] - v).abs().max().item()
                                                 for k, v in reference.state_dict().items()))
    return out


def reference_trajectory(reference: torch.nn.Module, optimizer: Callable, batch: dict,
                         steps: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """A single-process run's (loss, parameters after the step) for each of ``steps`` steps, to compare
    several compiled plans against one reference run (:func:`compare_trajectory`)."""
    opt = optimizer(reference.parameters())
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        out.append((loss.item(), {k: v.detach().clone() for k, v in reference.state_dict().items()}))
    return out


def compare_trajectory(compiled, trajectory: list, batch: dict, *, local: bool = False) -> dict[str, float]:
    """Train ``compiled`` as many steps as ``trajectory`` has; worst loss and parameter differences.
    ``local``: every rank holds whole parameters (data parallelism without TP, PP or ZeRO-3), so each
    step compares the rank's own parameters and only the last step gathers ``full_state_dict``."""
    out = {"loss": 0.0, "weights": 0.0}
    for i, (ref_loss, ref_state) in enumerate(trajectory):
        loss = compiled.step(**batch)
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss))
        last = i == len(trajectory) - 1
        state = compiled.model.state_dict() if local and not last else compiled.full_state_dict()
        out["weights"] = max(out["weights"], max((state[k] - v).abs().max().item() for k, v in ref_state.items()))
    return out



def shard_grad_diff(local, tp_result, ref_grads: dict[str, torch.Tensor], rank: int) -> float:
    """The largest difference between a TP rank's parameter gradients and the matching slices of the
    single-process gradients (``tp_result.layout(fqn).slice``; whole parameters compared whole)."""
    worst = 0.0
    for fqn, p in local.named_parameters():
        layout = tp_result.layout(fqn)
        want = ref_grads[fqn] if layout is None else layout.slice(ref_grads[fqn], rank)
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst
