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

:class:`SafetensorsWriter` writes safetensors files one tensor at a time (``fxpar.checkpoint.export_hf``).
"""

from __future__ import annotations

import copy
import json
import re
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
from fxpar.runtime.state import Held, place_tp


class WeightSource:
    """The tensors of one rank, from a state dict, safetensors files or the initialiser. ``rank``: this
    rank's tensor-parallel coordinate, the part of each sharded tensor :meth:`load` returns."""

    def __init__(self, model: torch.nn.Module, weights, seed: int = 0,
                 init: Callable[[torch.nn.Module], None] | None = None, rank: int = 0):
        self.model, self.seed, self.rank = model, seed, rank
        self.state: Mapping[str, torch.Tensor] = {}
        self.files: list = []
        self.source = None  # an object with read_shard(name, layout, rank), e.g. checkpoint.model_source
        if isinstance(weights, (str, Path)) and Path(weights).is_dir():
            weights = _directory(Path(weights))
        if hasattr(weights, "read_shard"):
            self.source = weights
        elif isinstance(weights, (str, Path)) and str(weights) != "init" or isinstance(weights, (list, tuple)):
            from safetensors import safe_open

            paths = [weights] if isinstance(weights, (str, Path)) else list(weights)
            self.files = [safe_open(str(p), framework="pt") for p in paths]
        elif isinstance(weights, Mapping):
            self.state = weights
        elif weights != "init":
            raise PlanError(f"weights={weights!r}: give a state dict, safetensors path(s) or 'init'")
        hf_init = getattr(model, "_init_weights", None)
        self.init = init or hf_init or _reset_parameters
        self._modules: dict[str, dict[str, torch.Tensor]] = {}

    def load(self, names: list[str], layout: ShardLayout | None, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the tensor known under ``names`` (aliases of one tied tensor), cut as
        ``layout`` says (None: the whole tensor)."""
        for name in names:
            if name in self.state:
                full = self.state[name]
                full = full.detach()  # copied: training never writes into the caller's state dict
                return self._checked(name, full.clone() if layout is None else layout.slice(full, self.rank), like)
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

    def done(self) -> None:
        self._modules.clear()

    def _init_module(self, path: str) -> dict[str, torch.Tensor]:
        module = copy.deepcopy(self.model.get_submodule(path))  # a meta module: no memory
        module.to_empty(device="cpu", recurse=False)  # only the module's own tensors are made
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + zlib.crc32(path.encode()))
            with torch.no_grad():
                self.init(module)
        return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}

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
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    if (path / "model.safetensors").is_file():
        return path / "model.safetensors"
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


def _reset_parameters(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _read_slice(f, name: str, layout: ShardLayout | None, rank: int) -> torch.Tensor:
    """``rank``'s part of a safetensors entry, reading only that part (one range per fused piece)."""
    if layout is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shape = sl.get_shape()
    parts = []
    for start, end in layout.ranges(shape[layout.dim], rank):
        index = [slice(None)] * len(shape)
        index[layout.dim] = slice(start, end)
        parts.append(sl[tuple(index)])
    return torch.cat(parts, dim=layout.dim) if layout.pieces else parts[0]


# ---- writing safetensors files (checkpoint.export_hf) ----------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``, as ``save_pretrained`` reads ``max_shard_size``: an int, or ``"5GB"`` (10**9),
    ``"5GiB"`` (2**30), ``"500MB"``, ...; a lower-case ``b`` means bits (``"5Gb"``: 5 * 10**9 / 8)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?[Bb]?)\s*", str(size), flags=re.IGNORECASE)
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS:
        raise PlanError(f"max_shard_size={size!r}: give bytes as an int or a size such as '5GB', '500MB', '2GiB'")
    bits = m.group(2).endswith("b")
    return int(float(m.group(1)) * _UNITS[unit] // (8 if bits else 1))


def _shards(entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list[int]]:
    """Indices of ``entries`` per file, as ``save_pretrained`` splits: in order, a new file when the next
    tensor would pass ``max_bytes``; a tensor larger than that alone in its own file."""
    files, current, size = [], [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        n = _nbytes(shape, dtype)
        if n > max_bytes:
            files.append([i])
            continue
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return files + [current] if current or not files else files


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """Writes safetensors files one tensor at a time. ``safetensors.torch.save_file`` needs every tensor of
    a file in memory at once; the format is simple enough to stream instead: an 8-byte little-endian
    header length, a JSON header (each tensor's dtype, shape and ``data_offsets`` in the data section,
    padded with spaces to 8 bytes), then the raw bytes. Offsets follow from shapes and dtypes, so each
    file's header is written first and each tensor lands at its offset as it arrives."""

    def __init__(self, directory: Path, max_shard_size):
        self.directory, self.max_bytes = directory, parse_size(max_shard_size)

    def begin(self, config, entries: list[tuple[str, tuple, torch.dtype]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(self.directory)
        files = _shards(entries, self.max_bytes)
        n = len(files)
        self.where: dict[str, tuple[Path, int]] = {}
        weight_map = {}
        for i, idx in enumerate(files):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for j in idx:
                name, shape, dtype = entries[j]
                if dtype not in _DTYPES:
                    raise PlanError(f"export_hf: {name} has dtype {dtype}, which safetensors does not store")
                end = offset + _nbytes(shape, dtype)
                header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
                weight_map[name] = fname
                offset = end
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            path = self.directory / fname
            with open(path, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw)
                f.truncate(8 + len(raw) + offset)
            for j in idx:
                self.where[entries[j][0]] = (path, 8 + len(raw) + header[entries[j][0]]["data_offsets"][0])
        index = self.directory / "model.safetensors.index.json"
        index.unlink(missing_ok=True)
        if n > 1:
            total = sum(_nbytes(s, d) for _, s, d in entries)
            index.write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        path, offset = self.where[name]
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(memoryview(data.numpy()))
