"""Writing safetensors files one tensor at a time, in ``save_pretrained``'s layout (``fxpar.checkpoint.export_hf``),
and :func:`parse_size`, ``max_shard_size`` as ``save_pretrained`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fxpar.ir import units
from fxpar.ir.errors import PlanError

# ---- writing safetensors files (checkpoint.export_hf) ----------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``, as ``save_pretrained`` reads ``max_shard_size``: an int, or ``"5GB"`` (10**9),
    ``"5GiB"`` (2**30), ``"500MB"``, ...; a lower-case ``b`` means bits (``"5Gb"``: 5 * 10**9 / 8)
    (:func:`fxpar.ir.units.parse_size`)."""
    return units.parse_size(size, "max_shard_size", bits=True)


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
