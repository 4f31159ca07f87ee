"""``MeshSpec``: the device mesh as pure data (degrees, axis names, rank <-> coordinates, group names).

A mesh of ``dp x pp x tp`` ranks, tensor parallel innermost: ``rank = (dp_rank * pp + pp_rank) * tp +
tp_rank``. It holds no process group, so passes, the cost model and the planner can reason about any
world size on one process (as JAX's ``AbstractMesh``); ``fxpar.runtime.groups`` turns it into a
``DeviceMesh`` and process groups.

Group names are ``"<axis>:<r0>,<r1>,..."``: the global ranks of this rank's group along an axis. The
name is the group's identity (two compiled models on the same ranks share a group; different ranks,
different names) and carries its size, which is all a fake kernel needs::

    >>> m = MeshSpec(dp=2, pp=2, tp=2, rank=5)
    >>> m.coords()
    {'dp': 1, 'pp': 0, 'tp': 1}
    >>> m.group_name("tp"), m.group_name("pp"), m.group_name("dp")
    ('tp:4,5', 'pp:5,7', 'dp:1,5')
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "pp", "tp")  # outermost first


@dataclass(frozen=True)
class MeshSpec:
    """Degrees of a ``dp x pp x tp`` mesh and the rank this process stands for."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"MeshSpec.{axis}={getattr(self, axis)}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"MeshSpec.rank={self.rank}: the mesh has {self.world_size} ranks")

    @classmethod
    def for_plan(cls, plan, rank: int = 0) -> MeshSpec:
        return cls(dp=plan.dp, pp=plan.pp, tp=plan.tp, rank=rank)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.dp, self.pp, self.tp

    def size(self, axis: str) -> int:
        return getattr(self, _axis(axis))

    # ---- rank <-> coordinates ---------------------------------------------------------------------
    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{"dp": d, "pp": p, "tp": t}`` of ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return {"dp": r // (self.pp * self.tp), "pp": (r // self.tp) % self.pp, "tp": r % self.tp}

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    def with_rank(self, rank: int) -> MeshSpec:
        return MeshSpec(self.dp, self.pp, self.tp, rank)

    # ---- groups -----------------------------------------------------------------------------------
    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis`` (the other coordinates fixed), in order."""
        axis = _axis(axis)
        c = self.coords(rank)
        out = []
        for i in range(self.size(axis)):
            c[axis] = i
            out.append(self.rank_of(**c))
        return out

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, each a list of global ranks, ordered by their first rank."""
        groups = {tuple(self.axis_ranks(axis, r)) for r in range(self.world_size)}
        return [list(g) for g in sorted(groups)]

    def group_name(self, axis: str, rank: int | None = None) -> str:
        """``"tp:4,5"``: the name of ``rank``'s group along ``axis``, its ranks listed."""
        return f"{_axis(axis)}:{','.join(map(str, self.axis_ranks(axis, rank)))}"

    def pipeline_ranks(self) -> list[int]:
        """The global rank of each pipeline position in this rank's pipeline (same dp and tp)."""
        return self.axis_ranks("pp")

    def __str__(self) -> str:
        return f"mesh dp={self.dp} x pp={self.pp} x tp={self.tp} (rank {self.rank}: {self.coords()})"


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}")
    return axis
