"""Batches and microbatches: how a global batch is cut, and how much each piece weighs in the loss.

Pure functions of the flattened user inputs (the order of ``Program.flatten_inputs``), shared by the
feasibility checks, the compile wiring and the runtime.
"""

from __future__ import annotations

import torch

from fxpar.ir.errors import PlanError


def batch_size(flat: list) -> int:
    """Dim 0 of the first tensor input that has one."""
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise PlanError("no tensor input with a batch dimension: fxpar needs one to cut microbatches")


def traced_batch(program) -> int:
    """The batch size a program was traced with (dim 0 of its first user tensor input)."""
    users = {b.placeholder for b in program.inputs if b.kind == "user"}
    return batch_size([n.meta.get("val") for n in program.graph.nodes if n.name in users])


def split_batch(flat: list, batch: int, m: int) -> list[list]:
    """Cut every tensor whose dim 0 is the batch into ``m`` microbatches; other values are shared. One
    microbatch is the inputs themselves, not views of them (a traced in-place update, a KV cache's, may
    not write a view that ``chunk`` made)."""
    if m == 1:
        return [list(flat)]
    out = [[] for _ in range(m)]
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            for i, piece in enumerate(v.chunk(m, dim=0)):
                out[i].append(piece)
        else:
            for i in range(m):
                out[i].append(v)
    return out


def signature(flat: list, spec) -> tuple:
    """What a compiled program is specific to: the pytree structure, and every tensor's shape and dtype
    (a graph traced for one sequence length must never run on another)."""
    return str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in flat)


def check_shapes(program, microbatch: list, names: list[str] | None = None) -> None:
    """Raise unless every tensor of ``microbatch`` (flattened user inputs) has the shape and dtype the
    program's placeholder was traced with (symbolic sizes match any size). A graph traced for one shape
    runs on no other: reshapes and expands baked into it would fail deep inside, or silently broadcast."""
    users = {b.placeholder: b.index for b in program.inputs if b.kind == "user"}
    names = names or flat_kwarg_names(program)
    for node in program.graph.nodes:  # called every step: placeholders come first, stop after them
        if node.op != "placeholder":
            break
        if node.name not in users:
            continue
        want, got = node.meta.get("val"), microbatch[users[node.name]]
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            continue
        sizes = [s if isinstance(s, int) else None for s in want.shape]
        if len(sizes) != got.dim() or any(w is not None and w != g for w, g in zip(sizes, got.shape)) \
                or want.dtype != got.dtype:
            name = names[users[node.name]] if users[node.name] < len(names) else node.name
            raise PlanError(f"input {name!r} of shape {tuple(got.shape)} ({got.dtype}) reached a program traced "
                            f"for {tuple(want.shape)} ({want.dtype}); each input shape gets its own program "
                            "(CompiledModel compiles one per shape): call the compiled model, not a stale program")


def flat_kwarg_names(program) -> list[str]:
    """The name of each flattened user input (positional ones as 'arg<i>')."""
    args_spec, kwargs_spec = program.in_spec.children()
    names = [f"arg{i}" for i in range(args_spec.num_leaves)]
    for key, child in zip(kwargs_spec.context or [], kwargs_spec.children()):
        names.extend([key] * child.num_leaves)
    return names


def counted_labels(labels: torch.Tensor, model: torch.nn.Module) -> int:
    """Label tokens ``model``'s loss counts: not ``-100``, after the causal LMs' shift by one. Which loss a
    model uses is decided as transformers decides it: ``model.loss_type``, else the class name's suffix."""
    loss_type = getattr(model, "loss_type", None) or type(model).__name__
    if loss_type.endswith("ForCausalLM"):
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def loss_weights(program, microbatches: list[list], model: torch.nn.Module) -> list[float]:
    """Each microbatch's share of the whole batch's mean loss: its count of counted label tokens.

    HF losses average over label tokens that are not ``-100``; causal LMs shift labels by one first.
    Which loss a model uses is decided as transformers decides it: ``model.loss_type``, else the class
    name's task suffix. Without labels, microbatches weigh the same.
    """
    flat_keys = flat_kwarg_names(program)
    if "labels" not in flat_keys:
        return [1.0 / len(microbatches)] * len(microbatches)
    idx = flat_keys.index("labels")
    counts = [counted_labels(mb[idx], model) for mb in microbatches]
    total = sum(counts)
    if total == 0:
        raise PlanError("every label is -100: the batch has no token to compute a loss on")
    return [c / total for c in counts]
