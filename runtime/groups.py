"""Named process groups for fxpar's collective ops: register, resolve, size.

A group is named by a string ("tp", "dp", "tp:0,1", "world") and resolved when an op runs. Fake
kernels need only its size, which the registry or a "label:r0,r1,..." name carries, so a program can be
traced for a group that does not exist yet. Without torch.distributed every group has one rank.
"""

import dataclasses
import datetime
from collections.abc import Sequence

import torch.distributed as dist

from fxpar.ir.errors import FxparError


@dataclasses.dataclass(frozen=True)
class _Group:
    pg: object  # a ProcessGroup, or None when only the size is known (tracing, planning)
    size: int
    member: bool = True  # False where new_group handed this rank a group it is not in


_GROUPS: dict[str, _Group] = {}


def _parse_ranks(name: str) -> tuple[int, ...] | None:
    """The ranks a "label:r0,r1,..." name lists, else None."""
    _, sep, tail = name.rpartition(":")
    if not sep or not tail:
        return None
    try:
        ranks = tuple(int(r) for r in tail.split(","))
    except ValueError:
        return None
    return ranks if len(set(ranks)) == len(ranks) and min(ranks) >= 0 else None


def register_group(name: str, process_group=None, *, size: int | None = None) -> None:
    """Make ``name`` stand for ``process_group`` in every fxpar op of this process (replacing an
    earlier registration). With no process group, ``size`` alone declares the group for tracing and
    cost analysis; running a real collective on it then fails unless ``size`` is 1."""
    if not isinstance(name, str) or not name:
        raise FxparError(f"a group name must be a non-empty string, got {name!r}")
    if process_group is None:
        if size is None or int(size) < 1:
            raise FxparError(f"register_group({name!r}): give a process group or a size >= 1 (got {size!r})")
        _GROUPS[name] = _Group(None, int(size))
        return
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or isinstance(process_group, int):
        # new_group hands ranks outside the group this sentinel (-100) instead of a ProcessGroup
        if size is None:
            raise FxparError(f"register_group({name!r}): this rank is not in the group; give its size")
        _GROUPS[name] = _Group(None, int(size), member=False)
        return
    pg_size = process_group.size()
    if size is not None and int(size) != pg_size:
        raise FxparError(f"register_group({name!r}): size={size} but the process group has {pg_size} ranks")
    _GROUPS[name] = _Group(process_group, pg_size)


def unregister_group(name: str) -> None:
    """Forget ``name`` (no error if it was not registered)."""
    _GROUPS.pop(name, None)


def registered_groups() -> dict[str, int]:
    """Registered group names and their sizes."""
    return {name: g.size for name, g in _GROUPS.items()}


def group_size(name: str) -> int:
    """How many ranks group ``name`` has: its registration, else the world for "world", else the
    ranks a "label:r0,r1" name lists, else 1 when torch.distributed is not initialised."""
    g = _GROUPS.get(name)
    if g is not None:
        return g.size
    if name == "world":
        return dist.get_world_size() if _dist_up() else 1
    ranks = _parse_ranks(name)
    if ranks is not None:
        return len(ranks)
    if not _dist_up():
        return 1
    raise FxparError(
        f"unknown process group {name!r} (registered: {sorted(_GROUPS) or 'none'}); "
        "register it with fxpar.runtime.ops.register_group or create it with new_group"
    )


def resolve_group(name: str):
    """The ProcessGroup that ``name`` stands for, or None for a one-rank group (no communication).
    "world" is the default group. Raises :class:`~fxpar.ir.errors.FxparError` for a group of several
    ranks that has no process group here, and for a rank that is not in the group."""
    g = _GROUPS.get(name)
    if g is None:
        if name == "world" and _dist_up():
            return dist.group.WORLD if dist.get_world_size() > 1 else None
        size = group_size(name)  # raises for an unknown name under torch.distributed
        if size == 1:
            return None
        raise FxparError(
            f"group {name!r} has {size} ranks but no process group is registered under that name"
            + ("" if _dist_up() else " (torch.distributed is not initialised)")
            + "; create it with fxpar.runtime.ops.new_group or register_group"
        )
    if not g.member:
        raise FxparError(f"this rank ({dist.get_rank()}) is not a member of group {name!r}")
    if g.pg is None:
        if g.size == 1:
            return None
        raise FxparError(f"group {name!r} was registered with size {g.size} only, without a process group")
    return g.pg


def new_group(name: str, ranks: Sequence[int], *, timeout: datetime.timedelta | None = None) -> str:
    """Create a process group over the global ``ranks`` and register it as ``name`` (every rank of
    the world must call this, in the same order, as for ``torch.distributed.new_group``)."""
    ranks = sorted(int(r) for r in ranks)
    pg = dist.new_group(ranks=ranks, timeout=timeout)
    register_group(name, pg, size=len(ranks))
    return name


def new_subgroups(label: str, groups: Sequence[Sequence[int]], *,
                  timeout: datetime.timedelta | None = None) -> str:
    """Create one process group per rank list (e.g. ``[[0, 1], [2, 3]]``) on every rank, register each
    as ``"label:r0,r1,..."`` and register ``label`` itself as the group holding this rank. Returns the
    full name of this rank's group."""
    me = dist.get_rank()
    mine = None
    for ranks in groups:
        ranks = sorted(int(r) for r in ranks)
        full = f"{label}:{','.join(map(str, ranks))}"
        new_group(full, ranks, timeout=timeout)
        if me in ranks:
            mine = full
            register_group(label, _GROUPS[full].pg)
    if mine is None:
        raise FxparError(f"new_subgroups({label!r}): rank {me} is in none of the groups {list(groups)}")
    return mine


def _dist_up() -> bool:
    return dist.is_available() and dist.is_initialized()
