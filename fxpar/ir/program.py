"""The traced program: an ATen-level GraphModule with lifted parameters, and how to call it.

A :class:`Program` is what every frontend produces and every pass consumes. Its graph takes, in
placeholder order, parameters, buffers, constants and the flattened user inputs (see
:class:`InputBinding`); it returns the flattened user outputs and, where the model mutates a buffer,
the new buffer values (:class:`OutputBinding`). Calling the program binds the live tensors of the
model it was traced from, so gradients land on the model's own parameters.

Parameter identity is the canonical FQN. Tied parameters (``lm_head.weight`` is
``model.embed_tokens.weight``) are one :class:`ParamInfo` with several FQNs and one placeholder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch.utils import _pytree as pytree

InputKind = Literal["parameter", "buffer", "constant", "user"]
OutputKind = Literal["user", "buffer_mutation"]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer of the traced model.

    ``fqn`` is the canonical name (the first the model lists); ``aliases`` the other names of the same
    tensor (tied weights). ``is_buffer`` tells buffers from parameters.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_buffer: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def fqns(self) -> tuple[str, ...]:
        return (self.fqn, *self.aliases)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def module(self) -> str:
        """FQN of the module that owns the tensor under its canonical name."""
        return self.fqn.rpartition(".")[0]


@dataclass(frozen=True)
class InputBinding:
    """What feeds one placeholder: a parameter/buffer by FQN, a constant by name, or user input #index."""

    kind: InputKind
    placeholder: str
    target: str | None = None  # FQN for parameter/buffer, constant name for constant
    index: int | None = None  # position in the flattened user inputs


@dataclass(frozen=True)
class OutputBinding:
    kind: OutputKind
    target: str | None = None  # buffer FQN for buffer_mutation


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the model that later passes use, read from the model and its HF config."""

    model_class: str = ""
    model_type: str | None = None
    base_model_prefix: str | None = None
    wrapper_prefix: str = ""  # FQN prefix of the model a wrapper holds (PEFT's "base_model.model."), else ""
    tp_plan: dict[str, str] | None = None  # full-model FQN globs (prefix applied) -> style
    pp_plan: dict[str, tuple[list[str], list[str]]] | None = None  # prefix applied
    tie_word_embeddings: bool | None = None
    num_layers: int | None = None
    layer_container: str | None = None  # FQN of the longest ModuleList of blocks
    config: dict[str, Any] = field(default_factory=dict)


class Program:
    """A traced model: graph + signature + the live tensors it binds.

    ``program(*args, **kwargs)`` returns what ``model(*args, **kwargs)`` returns.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        *,
        inputs: list[InputBinding],
        outputs: list[OutputBinding],
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        params: dict[str, ParamInfo],
        tensors: dict[str, torch.Tensor],
        constants: dict[str, Any],
        info: ModelInfo,
        frontend: str,
        root: torch.nn.Module | None = None,
    ):
        self.gm = gm
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.params = dict(params)  # canonical FQN -> ParamInfo (parameters and buffers)
        self._tensors = tensors  # canonical FQN -> live tensor of the model
        self.constants = constants
        self.info = info
        self.frontend = frontend
        self.root = root
        self._alias = {a: p.fqn for p in self.params.values() for a in p.fqns}

    def with_gm(self, gm: torch.fx.GraphModule) -> Program:
        """This program with another graph module (the same signature, parameters and tensors)."""
        return Program(gm, inputs=self.inputs, outputs=self.outputs, in_spec=self.in_spec, out_spec=self.out_spec,
                       params=self.params, tensors=self._tensors, constants=self.constants, info=self.info,
                       frontend=self.frontend, root=self.root)

    # ---- names -------------------------------------------------------------------------------------
    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def canonical(self, fqn: str) -> str:
        """Canonical FQN of a parameter or buffer given any of its names."""
        try:
            return self._alias[fqn]
        except KeyError:
            raise KeyError(f"{fqn!r} is not a parameter or buffer of this program") from None

    def tied_groups(self) -> list[tuple[str, ...]]:
        return [p.fqns for p in self.params.values() if p.aliases]

    def named_parameters(self):
        """(canonical FQN, live tensor) for every parameter, each tied group once."""
        for fqn, p in self.params.items():
            if not p.is_buffer:
                yield fqn, self._tensors[fqn]

    def named_buffers(self):
        for fqn, p in self.params.items():
            if p.is_buffer:
                yield fqn, self._tensors[fqn]

    def tensor(self, fqn: str) -> torch.Tensor:
        return self._tensors[self.canonical(fqn)]

    def set_tensor(self, fqn: str, value: torch.Tensor) -> None:
        """Replace the live tensor behind ``fqn`` (e.g. a meta tensor by its materialised shard)."""
        self._tensors[self.canonical(fqn)] = value

    def nodes(self, *, recurse: bool = True):
        """Every node of the graph, including those of higher-order-op subgraphs when ``recurse``."""
        yield from iter_nodes(self.gm, recurse=recurse)

    # ---- calling -----------------------------------------------------------------------------------
    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """Flatten call arguments in the order the graph's user-input placeholders expect."""
        want_args, want_kwargs = _spec_children(self.in_spec)
        if len(args) != want_args:
            raise TypeError(f"traced program takes {want_args} positional argument(s), got {len(args)}; "
                            "pass the same arguments as at trace time")
        if set(kwargs) != set(want_kwargs):
            missing = [k for k in want_kwargs if k not in kwargs]
            extra = [k for k in kwargs if k not in want_kwargs]
            raise TypeError(
                f"traced program was traced with keyword arguments {list(want_kwargs)}; missing {missing}, "
                f"unexpected {extra}. Trace again with example_kwargs that name every argument you will pass.")
        ordered = {k: kwargs[k] for k in want_kwargs}
        flat, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            raise TypeError(f"argument structure differs from the traced one:\n  traced: {self.in_spec}\n"
                            f"  given:  {spec}")
        return flat

    def bind(self, flat_user: list[Any]) -> list[Any]:
        """The full placeholder list for one call: live params/buffers, constants, user inputs."""
        out = []
        for b in self.inputs:
            if b.kind in ("parameter", "buffer"):
                out.append(self._tensors[b.target])
            elif b.kind == "constant":
                out.append(self.constants[b.target])
            else:
                out.append(flat_user[b.index])
        return out

    def __call__(self, *args, **kwargs):
        flat = self.flatten_inputs(args, kwargs)
        results = self.gm(*self.bind(flat))
        if not isinstance(results, (tuple, list)):
            results = (results,)
        user = []
        for b, value in zip(self.outputs, results):
            if b.kind == "buffer_mutation":
                with torch.no_grad():
                    self._tensors[b.target].copy_(value)
            else:
                user.append(value)
        return pytree.tree_unflatten(user, self.out_spec)

    def __repr__(self) -> str:
        n_nodes = sum(1 for _ in self.nodes())
        n_params = sum(p.numel for p in self.params.values() if not p.is_buffer)
        return (f"Program({self.info.model_class or 'model'}, frontend={self.frontend}, nodes={n_nodes}, "
                f"params={n_params:,}, tied={len(self.tied_groups())})")


def _spec_children(in_spec: pytree.TreeSpec) -> tuple[int, list[str]]:
    """(number of positional args, keyword names) of an export in_spec ``((args...), {kwargs})``."""
    args_spec, kwargs_spec = in_spec.children()
    keys = list(kwargs_spec.context) if kwargs_spec.context is not None else []
    return args_spec.num_children, keys


def graph_module(root: torch.nn.Module | dict, graph: torch.fx.Graph, class_name: str = "GraphModule"
                 ) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated when it is first called or read (torch.fx's
    ``_LazyGraphModule``), not on every ``recompile()``: a compile rewrites and recompiles each graph about
    three times and runs it once, and that code generation was about a tenth of the ranks' time in the
    tensor-parallel and pipeline tests. Dynamo needs the code made first (``runtime.compile``)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name)


def iter_nodes(gm: torch.fx.GraphModule, *, recurse: bool = True):
    """Nodes of ``gm`` and, when ``recurse``, of the subgraphs its higher-order ops and outlined
    submodules (``call_module`` of a graph, e.g. a recomputed layer) call, depth first."""
    for node in gm.graph.nodes:
        yield node
        if recurse:
            for sub in subgraphs_of(gm, node) + called_graphs(gm, node):
                yield from iter_nodes(sub, recurse=True)


def called_graphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graph a ``call_module`` node runs: the submodule itself if it is a GraphModule, else the
    GraphModules it wraps (its direct children)."""
    if node.op != "call_module":
        return []
    sub = gm.get_submodule(node.target)
    if isinstance(sub, torch.fx.GraphModule):
        return [sub]
    return [c for c in sub.children() if isinstance(c, torch.fx.GraphModule)]


def subgraphs_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """GraphModules a higher-order-op node calls (e.g. ``wrap_with_set_grad_enabled``'s body)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    subs = []
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(gm, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                subs.append(sub)
    return subs


_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(fqn: str) -> str:
    """The layer a module or parameter belongs to: ``model.layers.3.mlp.down_proj.weight`` ->
    ``model.layers.3``; names outside a numbered container keep their first two components."""
    m = _LAYER.match(fqn)
    return m.group(1) if m else ".".join(fqn.split(".")[:2]) or "<root>"
