"""Where a rank's tensors come from: each rank materialises only the shards it holds.

``compile(model, plan, weights=...)`` with a model built on the meta device (``with torch.device("meta")``)
fills in every tensor of the stages this rank runs, already cut for its tensor-parallel rank:

* a state dict keyed by the model's own (Hugging Face) FQNs: ``{"model.layers.0.mlp.up_proj.weight": ...}``;
* safetensors files (a path or a list of paths): only this rank's slice of each tensor is read
  (``safe_open(...).get_slice``), so a rank never holds a full tensor it shards;
* a checkpoint (``fxpar.checkpoint.model_source(path)``, or its directory): only the saved chunks that
  overlap this rank's shard of each tensor are read, whatever plan saved them;
* a Hugging Face model directory (``export_hf`` or ``save_pretrained`` output): its safetensors files;
* ``"init"``: the model's own initialiser, one module at a time (``_init_weights`` for transformers
  models, else each module's ``reset_parameters``): a module's full tensors exist only while it is
  initialised and cut. Each module draws from a generator seeded by its FQN, so every rank (and every
  plan) gets the same values whatever the order of stages and ranks.

Tensors a state dict does not hold (transformers' non-persistent buffers such as rotary frequencies)
come from the initialiser too. With ``weights=None`` a meta model stays on meta: enough to plan,
inspect and predict, not to run.

Writing safetensors files one tensor at a time (``fxpar.checkpoint.export_hf``) is
:mod:`fxpar.safetensors_writer`'s.
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fxpar.ir.errors import PlanError
from fxpar.ir.placement import ShardLayout
from fxpar.runtime.state import Held, flat_boxes, place_tp
from fxpar.safetensors_check import INDEX, open_shards, shard_paths

TAKEN = "_fxpar_tensors_taken"  # set on a model whose tensors :meth:`WeightSource.taking` took


def check_not_taken(model: torch.nn.Module, weights) -> None:
    """A model an earlier ZeRO-3 compile took the tensors of has only meta tensors left: compiling it again
    needs ``weights=`` (a PlanError before any communication)."""
    if weights is None and model.__dict__.get(TAKEN):
        raise PlanError(f"this {type(model).__name__}'s tensors were taken and freed by an earlier ZeRO-3 "
                        "compile (its parameters and buffers are on the meta device now), so there is nothing "
                        "to compile it from",
                        fix="pass weights= to this compile: first.full_state_dict(), a checkpoint "
                            "(checkpoint.save(first, dir, step); weights=dir) or the model directory it came from; "
                            "or build the model again")


class WeightSource:
    """The tensors of one rank, from a state dict, safetensors files or the initialiser. ``rank``: this
    rank's tensor-parallel coordinate, the part of each sharded tensor :meth:`load` returns."""

    def __init__(self, model: torch.nn.Module, weights, seed: int = 0,
                 init: Callable[[torch.nn.Module], None] | None = None, rank: int = 0):
        self.model, self.seed, self.rank = model, seed, rank
        self.state: Mapping[str, torch.Tensor] = {}
        self.paths: list[str] = []  # safetensors files, opened while a compile reads them (:attr:`files`)
        self._files: list | None = None
        self.source = None  # an object with read_shard(name, layout, rank), e.g. checkpoint.model_source
        if isinstance(weights, (str, Path)) and Path(weights).is_dir():
            weights = _directory(Path(weights))
        if hasattr(weights, "read_shard"):
            self.source = weights
        elif isinstance(weights, (str, Path)) and str(weights) != "init" or isinstance(weights, (list, tuple)):
            self.paths = [str(p) for p in ([weights] if isinstance(weights, (str, Path)) else weights)]
            self._files = self._open()  # headers read now: a bad file fails before any communication
        elif isinstance(weights, Mapping):
            self.state = weights
        elif weights != "init":
            raise PlanError(f"weights={weights!r}: give a state dict, safetensors path(s) or 'init'")
        hf_init = getattr(model, "_init_weights", None)
        self.init = init or hf_init or _reset_parameters
        self._modules: dict[str, dict[str, torch.Tensor]] = {}
        self.owned = False  # the state dict holds the model's own tensors, taken by :meth:`taking`
        self.released: set[str] = set()  # names freed by :meth:`release`: asking for them again is an error

    @classmethod
    def taking(cls, model: torch.nn.Module, rank: int = 0) -> WeightSource:
        """A source that takes a materialised model's tensors, leaving the model on the meta device (shapes,
        dtypes, ties and ``requires_grad`` kept), so that compiling it reads them as it reads ``weights=``:
        each rank keeps only its shards. ZeRO-3 compiles a materialised model this way; :meth:`release`
        then frees the full tensors (FSDP2's ``fully_shard`` frees them as it shards)."""
        state = {**dict(model.named_parameters(remove_duplicate=False)),
                 **dict(model.named_buffers(remove_duplicate=False))}
        to_meta(model)
        model.__dict__[TAKEN] = True  # compile refuses it without weights= from now on (nothing left to read)
        source = cls(model, state, rank=rank)
        source.owned = True
        return source

    def release(self, bound: set[str]) -> None:
        """After the first compile of a :meth:`taking` source: the model's tensors the program never binds
        (``bound``: every FQN it does) go back into the model; the others are dropped, freeing them unless
        the caller holds them too. Later signatures reuse what the first one loaded (``ctx.shared``)."""
        if not self.owned:
            return
        for name, t in self.state.items():
            if name not in bound:
                path, _, leaf = name.rpartition(".")
                module = self.model.get_submodule(path)
                (module._parameters if leaf in module._parameters else module._buffers)[leaf] = t
        self.released.update(n for n in self.state if n in bound)
        self.state = {}
        self._modules.clear()

    def load(self, names: list[str], layout: ShardLayout | None, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the tensor known under ``names`` (aliases of one tied tensor), cut as
        ``layout`` says (None: the whole tensor)."""
        self._check_released(names)
        for name in names:
            if name in self.state:
                full = self.state[name].detach()
                if layout is None and not self.owned:  # copied: training never writes into the caller's state
                    full = full.clone()
                return self._checked(name, full if layout is None else layout.slice(full, self.rank), like)
            for f in self.files:
                if name in f.keys():
                    return self._checked(name, _read_slice(f, name, layout, self.rank), like)
            if self.source is not None:
                t = self.source.read_shard(name, layout, self.rank)
                if t is not None:
                    return self._checked(name, t, like)
        name = names[0]
        path, _, leaf = name.rpartition(".")
        if path not in self._modules:
            self._modules[path] = self._init_module(path)
        full = self._modules[path][leaf]
        return full if layout is None else layout.slice(full, self.rank)

    def load_flat(self, names: list[str], layout: ShardLayout | None, like: torch.Tensor, start: int,
                  end: int) -> torch.Tensor:
        """Entries ``[start, end)`` of this rank's part of the tensor ``names`` (its row-major flattening,
        shape ``like.shape``), reading only those entries: a ZeRO-3 rank's slice of a flat bucket
        (``fxpar.passes.zero3``). 1-D, ``like``'s dtype."""
        out = torch.empty(end - start, dtype=like.dtype)
        full_shape = tuple(layout.full_shape(like.shape) if layout is not None else like.shape)
        boxes = flat_views(out, tuple(like.shape), start, end, layout, self.rank)
        self._check_released(names)
        for name in names:
            src = self.state.get(name) if name in self.state else None
            if src is not None:
                self._check_full(name, tuple(src.shape), full_shape)
                for o, view in boxes:
                    view.copy_(src.detach()[_index(o, view.shape)])
                return out
            for f in self.files:
                if name in f.keys():
                    sl = f.get_slice(name)
                    self._check_full(name, tuple(sl.get_shape()), full_shape)
                    for o, view in boxes:
                        view.copy_(sl[_index(o, view.shape)] if view.dim() else f.get_tensor(name))
                    return out
            if self.source is not None and self.source.read_boxes(name, full_shape, boxes):
                return out
        path, _, leaf = names[0].rpartition(".")
        if path not in self._modules:  # one module's full tensors at a time
            self._modules = {path: self._init_module(path)}
        full = self._modules[path][leaf]
        for o, view in boxes:
            view.copy_(full[_index(o, view.shape)])
        return out

    @property
    def files(self) -> list:
        """The safetensors files, memory-mapped until :meth:`done`: the pages a rank read count in its
        resident memory while the file stays mapped, so a compiled model must not keep them open."""
        if self._files is None:
            self._files = self._open()
        return self._files

    def _open(self) -> list:
        return open_shards(self.paths)  # a file the library refuses: named, with what is wrong and the fix

    def done(self) -> None:
        self._modules.clear()
        self._files = None

    def _check_released(self, names) -> None:
        gone = [n for n in names if n in self.released]
        if gone:
            raise PlanError(f"weights: {gone[0]} was released once ZeRO-3 sharded it (the model's full tensors "
                            "are freed after the first compile); a later input signature asked for it whole",
                            fix="compile with the inputs the program needs first, or keep the model's tensors "
                                "by passing weights= a state dict you hold")

    @staticmethod
    def _check_full(name: str, shape: tuple, want: tuple) -> None:
        if shape != want:
            raise PlanError(f"weights: {name} has shape {shape}, but the model needs {want}; the weights "
                            "belong to another configuration")

    def _init_module(self, path: str) -> dict[str, torch.Tensor]:
        module = copy.deepcopy(self.model.get_submodule(path))  # a meta module: no memory
        module.to_empty(device="cpu", recurse=False)  # only the module's own tensors are made
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + zlib.crc32(path.encode()))
            with torch.no_grad():
                self.init(module)
        # detached: the initialiser's values are data to copy from; its parameters require grad, so copying
        # them into views of a flat buffer (load_flat) would record the copies in autograd
        return {k: t.detach() for k, t in [*module.named_parameters(recurse=False),
                                           *module.named_buffers(recurse=False)]}

    @staticmethod
    def _checked(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) != tuple(like.shape):
            raise PlanError(f"weights: {name} has shape {tuple(t.shape)} on this rank, but the model needs "
                            f"{tuple(like.shape)}; the state dict belongs to another configuration")
        return t.to(like.dtype)


def _directory(path: Path):
    """A directory given as ``weights``: an fxpar checkpoint (a ``step_<N>`` directory or the one ``save``
    wrote into), or a Hugging Face model directory (``model.safetensors`` or an index of shards)."""
    if (path / ".metadata").is_file() or (path / "latest").is_file():
        return CheckpointReader(path)
    if (path / INDEX).is_file() or (path / "model.safetensors").is_file():
        return shard_paths(path)  # every file the index lists, present (else an InputError naming it)
    raise PlanError(f"weights={str(path)!r}: a directory with neither an fxpar checkpoint (.metadata, latest) "
                    "nor model.safetensors / model.safetensors.index.json")


# ---- reading checkpoints ---------------------------------------------------------------------------

class _ChunkLoadPlanner(LoadPlanner):
    """Reads into each :class:`Held` chunk (a view of this rank's memory) the parts of the saved chunks
    that overlap it (DCP's resharding: ``create_read_items_for_chunk_list``)."""

    def __init__(self, held: dict[str, Held], path):
        self.held, self.path = held, path

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, held in self.held.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None or tuple(md.size) != tuple(held.shape):
                found = "nothing" if md is None else f"shape {tuple(md.size)}"
                raise PlanError(f"checkpoint {self.path} has {found} under {key}, the model needs shape "
                                f"{tuple(held.shape)}: it belongs to another model or optimizer")
            chunks = [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in held.chunks]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def create_global_plan(self, plans):
        return plans

    def finish_plan(self, plan):
        return plan

    def load_bytes(self, item, value) -> None:
        raise PlanError(f"checkpoint {self.path}: unexpected non-tensor entry {item.dest_index.fqn}")

    def resolve_tensor(self, item) -> torch.Tensor:
        view = self.held[item.dest_index.fqn].chunks[item.dest_index.index][1]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(d, o, n)
        return view

    def commit_tensor(self, item, tensor) -> None:
        pass


class CheckpointReader:
    """One complete checkpoint directory, opened once: its DCP metadata and ``fxpar.json``. Reads are
    local (no collective): each rank asks for its own chunks."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if (path / "latest").is_file() and not (path / "fxpar.json").is_file():  # the directory save wrote into
            path = path / (path / "latest").read_text().strip()
        if not (path / "fxpar.json").is_file():
            raise PlanError(f"{path} is not a complete fxpar checkpoint (no fxpar.json); "
                            "use checkpoint.latest(dir) or the directory save wrote into")
        self.path, self.info = path, json.loads((path / "fxpar.json").read_text())
        self.reader = dcp.FileSystemReader(str(path))
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)
        self.aliases: dict[str, str] = self.info.get("aliases", {})

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.metadata.state_dict_metadata if k.startswith(prefix)]

    def read(self, held: dict[str, Held]) -> None:
        planner = _ChunkLoadPlanner(held, self.path)
        planner.set_up_planner({}, self.metadata)
        self.reader.read_data(self.reader.prepare_local_plan(planner.create_local_plan()), planner).wait()

    def read_shard(self, name: str, layout, rank: int) -> torch.Tensor | None:
        """TP rank ``rank``'s part (``layout``: a ShardLayout, None for whole) of the model tensor ``name``,
        reading only the saved chunks that overlap it; None when the checkpoint does not hold it."""
        key = "model." + self.aliases.get(name, name)
        md = self.metadata.state_dict_metadata.get(key)
        if md is None:
            return None
        shape = tuple(layout.local_shape(md.size, rank) if layout is not None else md.size)
        out = torch.empty(shape, dtype=md.properties.dtype)
        self.read({key: Held(tuple(md.size), out.dtype, place_tp(layout, rank, shape, (0,) * len(shape), out))})
        return out

    def read_boxes(self, name: str, full_shape: tuple, boxes: list[tuple[tuple, torch.Tensor]]) -> bool:
        """Boxes ``(offsets, view)`` of the model tensor ``name`` read into their views (the saved chunks
        overlapping each); False when the checkpoint does not hold it."""
        key = "model." + self.aliases.get(name, name)
        md = self.metadata.state_dict_metadata.get(key)
        if md is None:
            return False
        WeightSource._check_full(name, tuple(md.size), full_shape)
        if boxes:
            self.read({key: Held(tuple(md.size), boxes[0][1].dtype, list(boxes))})
        return True


def to_meta(model: torch.nn.Module) -> None:
    """Every parameter and buffer of ``model`` replaced by a meta tensor of its shape and dtype, in place:
    tied tensors stay one tensor (``Module.to("meta")`` would make a new one per name), parameters stay
    parameters with their ``requires_grad``."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, _meta_param), (module._buffers, _meta_like)):
            for name, t in table.items():
                if t is not None and not t.is_meta:
                    table[name] = memo.setdefault(id(t), make(t))


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _meta_param(p: torch.nn.Parameter) -> torch.nn.Parameter:
    return torch.nn.Parameter(_meta_like(p), requires_grad=p.requires_grad)


def flat_views(out: torch.Tensor, shape: tuple[int, ...], start: int, end: int, layout: ShardLayout | None,
               rank: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Where entries ``[start, end)`` of TP rank ``rank``'s part (shape ``shape``, cut by ``layout``) of a
    tensor lie in the full tensor: ``(offsets in the full tensor, a view of out)`` per box, ``out`` being
    the 1-D buffer of those entries. Reading each box of the full tensor into its view fills ``out``."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    views = []
    for o, z in flat_boxes(shape, start, end):
        at = sum(i * st for i, st in zip(o, strides)) - start
        views += place_tp(layout, rank, shape, o, out.as_strided(z, strides, out.storage_offset() + at))
    return views


def _index(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(offsets, sizes))


def _reset_parameters(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _read_slice(f, name: str, layout: ShardLayout | None, rank: int) -> torch.Tensor:
    """``rank``'s part of a safetensors entry, reading only that part (one range per fused piece), in memory
    of its own: safetensors hands out views of the memory-mapped file (the whole tensor's storage), which
    a rank must not keep (the file's pages would back its parameters, and a later write to the file
    would show through them)."""
    if layout is None:
        return f.get_tensor(name).clone()
    sl = f.get_slice(name)
    shape = sl.get_shape()
    parts = []
    for start, end in layout.ranges(shape[layout.dim], rank):
        index = [slice(None)] * len(shape)
        index[layout.dim] = slice(start, end)
        parts.append(sl[tuple(index)])
    return torch.cat(parts, dim=layout.dim) if layout.pieces else parts[0].clone()
