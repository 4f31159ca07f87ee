"""Named process groups for fxpar's collective ops: the mesh's groups, and register, resolve, size.

Reads: a :class:`~fxpar.ir.mesh.MeshSpec` (or rank lists) and torch.distributed. Writes: process groups
and this process's name -> group table, which the collective kernels (:mod:`fxpar.runtime.collectives`)
resolve when an op runs.

Group names are identities, not roles: :func:`mesh_groups` registers this rank's group along each mesh
axis under the full name the compiler writes into graphs, ``MeshSpec.group_name(axis)`` (``"tp:0,1"``,
``"dp:0,2"``). Two compiled models with different plans in one process therefore never share a group
of the wrong ranks, and a fake kernel sizes a group from its name alone (:mod:`fxpar.ir.ops`). The
low-level :func:`register_group` / :func:`new_group` / :func:`new_subgroups` stay for tests and tools
that name groups by hand ("tp", "world"); their table is :data:`fxpar.ir.ops.REGISTERED_GROUPS`, so the
fake kernels size those too. Without torch.distributed every group has one rank.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from fxpar.ir import ops as ir_ops
from fxpar.ir.errors import FxparError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.ops import dist_up as _dist_up

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclasses.dataclass(frozen=True)
class _Group:
    pg: object  # a ProcessGroup, or None when only the size is known (tracing, planning)
    size: int
    member: bool = True  # False where new_group handed this rank a group it is not in


_GROUPS: dict[str, _Group] = ir_ops.REGISTERED_GROUPS  # the IR's table: fake kernels size these names too


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


def release_process_groups() -> None:
    """Forget every registered process group (sizes-only registrations stay), for the exit hook that
    destroys the group (:func:`fxpar.launch.init_distributed`). ``destroy_process_group`` shuts gloo's
    groups down but does not join their threads; that happens only when the last reference to a group
    goes, and a reference held here would keep it to the interpreter's teardown, where threads of gloo
    still running while the process exits abort it now and then ("terminate called without an active
    exception", after a run that succeeded)."""
    for name in [n for n, g in _GROUPS.items() if g.pg is not None or not g.member]:
        del _GROUPS[name]


def registered_groups() -> dict[str, int]:
    """Registered group names and their sizes."""
    return {name: g.size for name, g in _GROUPS.items()}


def group_size(name: str) -> int:
    """How many ranks group ``name`` has: its registration, else the world for "world", else the
    ranks a "label:r0,r1" name lists, else 1 when torch.distributed is not initialised."""
    return ir_ops.group_size(name)


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
            + "; create it with fxpar.runtime.groups.new_group or register_group"
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


def mesh_groups(spec: MeshSpec, device_type: str, dp_axis: str = "dp_replicate") -> DeviceMesh | None:
    """Build the ``(dp, pp, tp)`` ``DeviceMesh`` of ``spec`` (``(dp, ep, pp, tp)`` with ep > 1; every rank
    of the world calls this, in the same order: it creates process groups) and register this rank's group
    along each axis under its full name, ``spec.group_name(axis)``, and with ep > 1 its group of data replicas
    (``spec.replica_group_name()``). ``dp_axis`` names the mesh's data-parallel dimension
    (``"dp_shard"`` under ZeRO, ``"dp_replicate"`` without); with HSDP (``spec.dp_replicate > 1``) the mesh is
    ``(dp_replicate, dp_shard, pp, tp)`` and the shard, replica and whole dp groups are registered under
    their names (``spec.shard_group_name()``, ...). Returns the mesh; None for a world of
    one rank, where nothing is registered (a one-rank name resolves to no group already)."""
    if spec.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if spec.dp_replicate > 1:  # HSDP: the dp dimension as (dp_replicate, dp_shard), replicas outermost
        mesh = init_device_mesh(device_type, (spec.dp_replicate, spec.dp_per_shard, *spec.shape[1:]),
                                mesh_dim_names=("dp_replicate", "dp_shard", *spec.axes[1:]))
        register_group(spec.replicate_group_name(), mesh.get_group("dp_replicate"))
        register_group(spec.group_name("dp"), mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group())
        for axis in spec.axes[1:]:
            register_group(spec.group_name(axis), mesh.get_group(axis))
        if spec.cp == 1:
            register_group(spec.shard_group_name(), mesh.get_group("dp_shard"))
        else:  # context parallelism: a shard group is its dp / dp_replicate ranks x cp (not one mesh dimension)
            _new_groups(spec, spec.shard_ranks, spec.shard_group_name(), mesh.get_group("cp"))
        return mesh
    dims = tuple(dp_axis if a == "dp" else a for a in spec.axes)  # ("dp", "ep", "pp", "tp") with ep > 1
    mesh = init_device_mesh(device_type, spec.shape, mesh_dim_names=dims)
    for axis, dim in zip(spec.axes, dims):
        register_group(spec.group_name(axis), mesh.get_group(dim))
    if spec.ep > 1:  # expert parallelism: dense gradients average over every data replica (dp x ep)
        _new_groups(spec, spec.replica_ranks, spec.replica_group_name())
    if spec.cp > 1:  # context parallelism: gradients reduce (ZeRO shards) over dp x cp
        _new_groups(spec, spec.grad_ranks, spec.grad_group_name(), mesh.get_group("cp"))
        if spec.ep > 1:  # an expert slice's: over the dp x cp ranks of its ep rank
            _new_groups(spec, lambda r: spec.grad_ranks(r, experts=True), spec.grad_group_name(experts=True),
                        mesh.get_group("cp"))
    return mesh


def _new_groups(spec: MeshSpec, ranks_of, name: str, cp_group=None) -> None:
    """Create the process group of every rank's ``ranks_of(rank)`` (every rank creates each, in the same order)
    and register this rank's under ``name``; a group of just this rank's cp ranks is ``cp_group`` where given."""
    for ranks in sorted({tuple(ranks_of(r)) for r in range(spec.world_size)}):
        same_as_cp = cp_group is not None and len(ranks) == spec.cp
        pg = cp_group if same_as_cp else dist.new_group(list(ranks))
        if spec.rank in ranks:
            register_group(name, pg)

