"""Safetensors files checked before any rank loads them: headers only, no tensor data read.

:func:`shard_paths` reads a Hugging Face model directory's ``model.safetensors.index.json`` (or takes its
``model.safetensors``) and checks that every file the index lists is there; :func:`open_shards` opens
each file with the safetensors library, which reads its header and checks it (JSON, dtypes it knows,
every tensor's byte range inside the file, the data covered exactly), and where given the index checks
that each file holds the tensors the index assigns to it. A file the library refuses is an
:class:`~fxpar.ir.errors.InputError` naming the file (shard ``i`` of ``N``), what is wrong with it in
numbers, and the fix; :func:`check_directory` does all of it for a directory (``fxpar train`` and
``fxpar generate`` call it before joining the process group), :func:`check_weights` for whatever
``compile(weights=...)`` is given (before it joins the process group under torchrun).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fxpar.ir.errors import InputError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT = 100_000_000  # the library's own limit on a header's length: longer is not a safetensors file
AGAIN = "copy or download that file again, or write the model again with save_pretrained"


def shard_paths(directory: str | Path) -> list[Path]:
    """The safetensors files of a model directory, sorted by name (each once: ``model-0000i-of-0000N`` is
    shard i), all present: an
    index that cannot be read, or a file it lists that is missing, is an :class:`InputError`."""
    directory = Path(directory)
    index = directory / INDEX
    if not index.is_file():
        return [directory / SINGLE]
    names = sorted(set(weight_map(directory).values()))
    missing = [(i, n) for i, n in enumerate(names) if not (directory / n).is_file()]
    if missing:
        i, name = missing[0]
        more = f" (and {len(missing) - 1} more: {', '.join(n for _, n in missing[1:4])}" \
               f"{', ...' if len(missing) > 4 else ''})" if len(missing) > 1 else ""
        raise InputError(f"weights: {directory / name} (shard {i + 1} of {len(names)}) is missing, listed in {INDEX}"
                         f"{more}", path=directory / name,
                         fix=f"copy the missing shard{'s' if len(missing) > 1 else ''} into {directory}, or write the "
                             "model again with save_pretrained")
    return [directory / n for n in names]


def weight_map(directory: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> file name)."""
    index = directory / INDEX
    try:
        data = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"weights: {index} is not valid JSON ({e})", path=index,
                         fix="write the model again with save_pretrained, "
                             "which writes the index with its shards") from e
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict) or not data["weight_map"]:
        raise InputError(f"weights: {index} has no weight_map (tensor name -> file), which a sharded model's index "
                         "holds", path=index, fix="write the model again with save_pretrained")
    return data["weight_map"]


def open_shards(paths: list[str | Path], index: dict[str, str] | None = None) -> list:
    """Each file opened with ``safetensors.safe_open`` (memory-mapped; the header read and checked); a
    file it refuses is an :class:`InputError` saying which of the files and what is wrong. With ``index``
    (a ``weight_map``), each file must hold every tensor the index places in it."""
    out = []
    for i, path in enumerate(paths):
        which = f"{path} (shard {i + 1} of {len(paths)})" if len(paths) > 1 else str(path)
        f = open_checked(path, which)
        if index is not None:
            keys = set(f.keys())
            absent = [k for k, v in index.items() if v == Path(path).name and k not in keys]
            if absent:
                raise InputError(f"weights: {INDEX} places {len(absent)} tensor{'s' if len(absent) > 1 else ''} "
                                 f"in {which}, which does not hold {'them' if len(absent) > 1 else 'it'}: "
                                 f"{', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}", path=path,
                                 fix="the index and its shards belong to different saves: " + AGAIN)
        out.append(f)
    return out


def check_directory(directory: str | Path) -> None:
    """Every safetensors file of a model directory checked (:func:`shard_paths`, :func:`open_shards`);
    nothing kept open."""
    directory = Path(directory)
    index = weight_map(directory) if (directory / INDEX).is_file() else None
    open_shards(shard_paths(directory), index)


def check_weights(weights) -> None:
    """``compile(weights=...)`` given safetensors files or a model directory: every file checked as
    :func:`check_directory` does, before ``compile`` joins the process group (nothing kept open). A
    state dict, ``"init"``, an fxpar checkpoint or a reader object: nothing to check here."""
    if isinstance(weights, (list, tuple)) and all(isinstance(w, (str, Path)) for w in weights):
        open_shards(list(weights))
    elif isinstance(weights, (str, Path)) and str(weights) != "init":
        path = Path(weights)
        if not path.is_dir():
            open_shards([path])
        elif not ((path / ".metadata").is_file() or (path / "latest").is_file()) and (
                (path / INDEX).is_file() or (path / SINGLE).is_file()):
            check_directory(path)


def open_checked(path: str | Path, which: str | None = None):
    """``safe_open(path)``, or an :class:`InputError` naming ``which`` (the file, with its place among
    the shards) and what is wrong with it."""
    from safetensors import SafetensorError, safe_open

    which = which or str(path)
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError as e:
        raise InputError(f"weights: {which} does not exist", path=path, fix="give the path of a .safetensors file, "
                         "or the model directory save_pretrained wrote") from e
    except SafetensorError as e:
        what, fix = explain(Path(path), str(e))
        raise InputError(f"weights: {which}: {what}", path=path, fix=fix) from e


def explain(path: Path, error: str) -> tuple[str, str]:
    """What is wrong with a file the safetensors library refused (its message ``error``), and the fix.

    The 8-byte header length and the JSON header are read here because the library's messages do not
    say it: a cut-short file is "incomplete metadata, file not fully covered" with no numbers, a file
    that is not safetensors at all (a Git LFS pointer, a pickle) "header too large", and an unknown dtype
    does not name its tensor. Nothing past the header is read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if head.startswith(b"version https://git-lfs"):
            return ("not a safetensors file but a Git LFS pointer (the weights were never downloaded)",
                    f"run `git lfs pull` in {path.parent}, or download the model again")
        if len(head) < 8:
            return (f"not a safetensors file: {size} bytes, fewer than the 8 of its header length",
                    AGAIN)
        length = int.from_bytes(head[:8], "little")
        looks_json = head[8:9] == b"{"
        if not looks_json or length > HEADER_LIMIT:
            return (f"not a safetensors file (it does not begin with a header length and a JSON header; "
                    f"the library says: {error})", "replace it with the safetensors file save_pretrained writes")
        if length > size - 8:
            return (f"truncated: its header length says {length:,} bytes of header, the file has {size - 8:,} "
                    "after the length", AGAIN)
        f.seek(8)
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return f"not a safetensors file: its header is not JSON ({e})", AGAIN
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else {}
    unknown = re.search(r"unknown variant `([^`]+)`", error)
    if unknown:
        named = [k for k, v in tensors.items() if isinstance(v, dict) and v.get("dtype") == unknown.group(1)]
        return (f"tensor {named[0] if named else '?'} has dtype {unknown.group(1)!r}, which this safetensors "
                f"{_version()} does not know", "write the weights in a dtype safetensors knows (save_pretrained "
                "with torch_dtype bfloat16 or float32), or update safetensors")
    ends = [v["data_offsets"][1] for v in tensors.values()
            if isinstance(v, dict) and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    data = size - 8 - length
    end = max(ends, default=0)
    if end > data:
        cut = [k for k, v in tensors.items() if isinstance(v, dict) and v.get("data_offsets", [0, 0])[1] > data]
        return (f"truncated: header says {end:,} bytes of data, file has {data:,} ({len(cut)} of {len(tensors)} "
                f"tensors end past it, e.g. {cut[0]})", AGAIN)
    if end < data:
        return (f"{data - end:,} bytes after the last tensor's data (the header accounts for {end:,} bytes of data, "
                f"the file has {data:,}): the file was overwritten or appended to", AGAIN)
    return f"safetensors could not read it: {error}", AGAIN


def _version() -> str:
    import safetensors

    return getattr(safetensors, "__version__", "")
