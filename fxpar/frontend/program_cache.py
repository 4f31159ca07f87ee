"""Captured programs kept on disk across runs (``FXPAR_PROGRAM_CACHE``), so an unchanged model is not traced
again: :func:`key` names what a capture depends on, :func:`load` and :func:`save` read and write it.

Reads: the model (its class, config, every submodule's class, training flag and attributes, the source
files those classes come from, every parameter's and buffer's name, shape, dtype and device), the example
inputs (pytree structure, tensor shapes, dtypes, devices; other values by repr), the capture options, and
the torch, transformers and fxpar versions with fxpar's frontend sources. Writes: ``<dir>/<key>.pkl``.

Only the export frontend's programs are kept, and only with static shapes or ``dynamic=True`` (a
``dynamic_shapes`` dict holds ``Dim`` objects without a stable text). The weights are not written: the
saved program's state dict holds meta tensors of the same shapes (lowering binds the model's own tensors).
A file that does not load (another torch, a damaged write) is traced again and rewritten; a program that
cannot be written (a symbolic size, a user ``autograd.Function``, a node named in another node's meta) is
used as traced and not kept. A model the key cannot read (:func:`_unnamed`) and inputs nested in a registered
pytree node (a KV cache) are traced every time.

The file is the pickled ``ExportedProgram`` (:class:`_Pickler`), not ``torch.export.save``'s archive: for a
two-layer Llama ``torch.export.load`` took 1.7 s here, as long as the trace it replaces (its deserialiser
resolves type hints per field), where the pickle loads in 0.04 s. The stock pickling of a ``GraphModule``
keeps only its code and traces it again on load, losing every node's ``meta`` (``val``, ``nn_module_stack``),
so the graph is kept node for node; fake tensors are kept as their storages (shared as traced) and layouts,
and made again in one fresh ``FakeTensorMode`` per file. A pickle is tied to the torch and fxpar versions,
which the key holds; the directory is the user's own, as Inductor's caches are.

Processes that capture the same program at once (the ranks of one host) take turns on ``<key>.lock``
(:func:`turn`): the first traces and writes, the others load what it wrote.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import pickle
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when what a file holds changes
_PLAIN = (bool, int, float, str, type(None))
_FRONTEND_DIR = Path(__file__).parent


def cacheable(frontend: str, dynamic) -> bool:
    """Whether a capture with these options may be kept (the export frontend, bool ``dynamic``)."""
    return frontend in ("auto", "export") and isinstance(dynamic, bool)


def key(model: torch.nn.Module, example_args: tuple, example_kwargs: dict, *, frontend: str, dynamic: bool,
        stack_traces: bool) -> str | None:
    """The hex digest naming the program ``model`` captures from these inputs and options; None where the
    model cannot be named (:func:`_unnamed`), so it is traced every time."""
    if _unnamed(model) or not _plain_containers(pytree.tree_structure((tuple(example_args), dict(example_kwargs)))):
        return None
    parts = {
        "format": FORMAT,
        "versions": [torch.__version__, _version("transformers"), _version("fxpar"),
                     _sources_digest(tuple(sorted(str(p) for p in _FRONTEND_DIR.glob("*.py"))))],
        "options": [frontend, dynamic, stack_traces],
        "config": _config_text(model),
        "modules": [[name, _class_name(type(m)), m.training, _plain_attributes(m)]
                    for name, m in model.named_modules(remove_duplicate=False)],
        "sources": _sources_digest(tuple(sorted({_source_file(type(m)) for m in model.modules()} - {""}))),
        "tensors": [[name, list(t.shape), str(t.dtype), t.device.type, bool(t.requires_grad)]
                    for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)]],
        "inputs": _inputs(example_args, example_kwargs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _unnamed(model: torch.nn.Module) -> bool:
    """Whether forward may depend on what no key can read: a module class defined inside a function (two
    calls make classes of one name and one source that compute apart, through the call's variables), a
    forward hook, or a callable kept on a module that is not a function named at module level (a lambda, a
    ``functools.partial`` and its arguments, a replaced ``forward`` made in a function)."""
    for m in model.modules():
        if "<locals>" in type(m).__qualname__ or m._forward_hooks or m._forward_pre_hooks:
            return True
        if any(callable(v) and not isinstance(v, (torch.nn.Module, type)) and _function_name(v) is None
               for v in vars(m).values()):
            return True
    return False


def _plain_containers(spec: pytree.TreeSpec) -> bool:
    """Whether the inputs nest only in tuples, lists and dicts. A registered node such as a KV cache holds
    objects in its spec (the model's config) that a loaded program's spec would hold copies of, and the
    program checks its inputs' spec against the traced one."""
    if spec.is_leaf():
        return True
    return spec.type in (tuple, list, dict) and all(_plain_containers(c) for c in spec.children())


def _function_name(v) -> str | None:
    """``module.qualname`` of a function or bound method defined at a module's top level (or in a class
    there), or of a ``functools.partial`` of one with arguments of plain types; None for anything else."""
    if isinstance(v, functools.partial):
        inner = _function_name(v.func)
        arguments = [*v.args, *v.keywords.values()]
        if inner is None or not all(isinstance(a, _PLAIN) for a in arguments):
            return None
        return f"partial({inner}, {v.args!r}, {sorted(v.keywords.items())!r})"
    fn = getattr(v, "__func__", v)
    if not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        return None
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        return None
    return f"{fn.__module__}.{fn.__qualname__}"


def load(directory: Path, name: str) -> torch.export.ExportedProgram | None:
    """The program saved under ``name``, or None (none saved, or it does not load)."""
    path = directory / f"{name}.pkl"
    if not path.is_file():
        return None
    try:
        _LOADING.append(FakeTensorMode())
        with open(path, "rb") as f:
            ep = pickle.load(f)
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"it holds a {type(ep).__name__}")
        return ep
    except Exception as exc:  # another torch's file, or a damaged one: traced again and rewritten
        log.info("fxpar: the cached program %s does not load (%s: %s); tracing again", path,
                 type(exc).__name__, exc)
        return None
    finally:
        _LOADING.pop()


def save(directory: Path, name: str, ep: torch.export.ExportedProgram) -> bool:
    """Write ``ep`` under ``name`` without its weights (meta tensors in their place); False where it
    cannot be pickled. The file appears whole or not at all (written, then renamed)."""
    light = copy.copy(ep)
    light._state_dict = {k: _meta_like(v) for k, v in ep.state_dict.items()}
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(light)
        os.replace(tmp, directory / f"{name}.pkl")
        return True
    except Exception as exc:  # a symbolic shape, a function defined inside another: used as traced, not kept
        log.info("fxpar: the traced program is not cached: it does not pickle (%s: %s)", type(exc).__name__, exc)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def turn(directory: Path, name: str):
    """Hold ``<name>.lock`` in ``directory``: processes capturing the same program trace it once between
    them. The lock is the operating system's (``flock``), so a process that dies lets the next one in;
    where the directory does not support it, every process traces for itself."""
    try:
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        f = open(directory / f"{name}.lock", "a")
    except (ImportError, OSError):  # no fcntl (Windows) or no writable directory
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


_LOADING: list[FakeTensorMode] = []  # the fake mode of the file being loaded (one per file)
_FUNCTION_OP = "fxpar::autograd_function"  # fxpar.ir.function_op: its calls live in the tracing process
_GM_DERIVED = ("_code", "_lineno_map", "_prologue_start", "forward")  # made again by recompile()


class _Storage:
    """One storage the program's fake tensors live in, pickled once however many views read it (the cost
    model tells saved activations apart by storage); on load, one meta storage of the same size."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __getstate__(self):
        return {"nbytes": self.nbytes}

    def meta(self) -> torch.UntypedStorage:
        if "_meta" not in self.__dict__:
            self._meta = torch.UntypedStorage(self.nbytes, device="meta")
        return self._meta


class _Pickler(pickle.Pickler):
    """Pickles operators by name, a ``GraphModule`` with its graph (not its code) and a static-shaped fake
    tensor by its storage and layout; a symbolic size fails the dump (the program is then not kept), as does
    a user ``autograd.Function`` (its op finds the Function in the tracing process's own table)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._storages: dict[int, _Storage] = {}

    def reducer_override(self, obj):
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            qualified = obj._schema.name if isinstance(obj, torch._ops.OpOverload) else obj._qualified_op_name
            if qualified == _FUNCTION_OP:
                raise pickle.PicklingError("a user autograd.Function, kept in this process's table")
            overload = obj._overloadname if isinstance(obj, torch._ops.OpOverload) else None
            return _operator, (*qualified.split("::", 1), overload)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, FakeTensor):
            storage = obj.untyped_storage()
            layout = (*obj.shape, *obj.stride(), obj.storage_offset())
            if not all(isinstance(v, int) for v in layout):
                raise pickle.PicklingError("a fake tensor with a symbolic size")
            shared = self._storages.setdefault(storage._cdata, _Storage(_storage_bytes(obj, storage)))
            if _reach(obj) > shared.nbytes:
                raise pickle.PicklingError("views of one storage of a symbolic size")
            return _fake, (shared, tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype,
                           str(obj.device), obj.requires_grad)
        if isinstance(obj, GraphModule):
            state = {k: v for k, v in obj.__dict__.items() if k not in _GM_DERIVED}
            return _new_graph_module, (), state, None, None, _set_graph_module
        if isinstance(obj, torch.fx.Graph):
            return _graph, (obj._codegen, obj._tracer_cls, obj._tracer_extras, _node_records(obj))
        if isinstance(obj, torch.fx.Node):  # only as a record's _Ref; one anywhere else (a meta entry): not kept
            raise pickle.PicklingError(f"node {obj.name} is referred to outside the graph's records")
        return NotImplemented


def _reach(t: torch.Tensor) -> int:
    """The bytes of storage a static-shaped tensor reaches."""
    return compute_required_storage_length(t.shape, t.stride(), t.storage_offset()) * t.element_size()


def _storage_bytes(t: torch.Tensor, storage) -> int:
    """The storage's size. An input traced from a view (a microbatch sliced from its batch) has a base of
    a symbolic size: the loaded program's storage is then what the tensor reaches."""
    nbytes = storage.nbytes()
    return nbytes if isinstance(nbytes, int) else _reach(t)


def _operator(namespace: str, name: str, overload: str | None):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)


def _fake(storage: _Storage, shape, stride, offset, dtype, device, requires_grad):
    meta = torch.empty(0, dtype=dtype, device="meta").set_(storage.meta(), offset, shape, stride)
    t = FakeTensor(_LOADING[-1], meta, torch.device(device))
    return t.requires_grad_(True) if requires_grad else t


class _Ref:
    """A node argument in a pickled graph: the index of the node it names."""

    def __init__(self, index: int):
        self.index = index


def _node_records(graph: torch.fx.Graph) -> list:
    """The graph as a flat list, one record per node, arguments naming nodes by index. Pickling the nodes
    themselves recurses through their links and arguments, as deep as the graph is long (an 8-layer Llama
    exceeded Python's recursion limit)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    refer = functools.partial(torch.fx.node.map_arg, fn=lambda n: _Ref(index[n]))
    return [(n.op, n.target, refer(n.args), refer(n.kwargs), n.name, n.type, n.meta) for n in graph.nodes]


def _graph(codegen, tracer_cls, tracer_extras, records: list) -> torch.fx.Graph:
    graph = torch.fx.Graph(tracer_cls=tracer_cls, tracer_extras=tracer_extras)
    graph._codegen = codegen
    nodes: list[torch.fx.Node] = []

    def resolve(a):
        return nodes[a.index] if isinstance(a, _Ref) else a
    for op, target, args, kwargs, name, type_expr, meta in records:
        node = graph.create_node(op, target, torch.fx.node.map_aggregate(args, resolve),
                                 torch.fx.node.map_aggregate(kwargs, resolve), name, type_expr)
        node.meta = meta
        nodes.append(node)
    return graph


def _new_graph_module():
    return GraphModule.__new__(GraphModule)  # its own subclass, as every GraphModule has


def _set_graph_module(gm: GraphModule, state: dict) -> None:
    graph = state.pop("_graph")
    gm.__dict__.update(state)
    gm.graph = graph  # owns it, and recompiles


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    return torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta


def _inputs(example_args: tuple, example_kwargs: dict) -> list:
    leaves, spec = pytree.tree_flatten((tuple(example_args), dict(example_kwargs)))
    described = [[list(v.shape), str(v.dtype), v.device.type, bool(v.requires_grad)]
                 if isinstance(v, torch.Tensor) else repr(v) for v in leaves]
    return [str(spec), described]


def _config_text(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return _value_text(config) if callable(getattr(config, "to_json_string", None)) else None


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}  # hooks, parameter and child tables


def _plain_attributes(m: torch.nn.Module) -> list:
    """Every attribute a module keeps besides its children, parameters and buffers (forward may read it):
    as text (:func:`_value_text`)."""
    return sorted([k, _value_text(v)] for k, v in vars(m).items()
                  if k not in _MODULE_INTERNALS and not isinstance(v, torch.nn.Module))


def _value_text(v) -> str:
    """A value as the key reads it: plain values and containers of them (PEFT's ``scaling`` dict, whose
    number rsLoRA changes) by ``repr``; a tensor kept as a plain attribute by its contents (the trace keeps
    it as a constant); a function by its qualified name; a config by its JSON; anything else by ``repr``
    (a default one holds the object's address, so it never matches another process's)."""
    if isinstance(v, (*_PLAIN, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(map(_value_text, v)) if isinstance(v, (set, frozenset)) else list(map(_value_text, v))
        return f"{type(v).__name__}[{', '.join(items)}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_value_text(k)}: {_value_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, torch.Tensor):
        contents = "" if v.is_meta else hashlib.sha256(v.detach().cpu().contiguous().view(-1).view(torch.uint8)
                                                       .numpy().tobytes()).hexdigest()
        return f"tensor{list(v.shape)}{v.dtype}{contents}"
    if (name := _function_name(v)) is not None:
        return name
    try:  # a transformers config, with the private settings its JSON leaves out (which attention kernels run)
        return v.to_json_string(use_diff=False) + repr(sorted(
            (k, x) for k, x in vars(v).items() if k.startswith("_") and isinstance(x, _PLAIN)))
    except (AttributeError, TypeError):
        return repr(v)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _source_file(cls: type) -> str:
    try:
        return inspect.getsourcefile(cls) or ""
    except TypeError:  # a builtin class
        return ""


def _sources_digest(paths: tuple[str, ...]) -> str:
    """One digest over the files' contents (each read once per size and modification time)."""
    h = hashlib.sha256()
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        h.update(p.encode())
        h.update(_file_digest(p, st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
