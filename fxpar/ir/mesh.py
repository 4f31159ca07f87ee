"""``MeshSpec``: the device mesh as pure data (degrees, axis names, rank <-> coordinates, group names).

A mesh of ``dp x ep x pp x cp x tp`` ranks, tensor parallel innermost: ``rank = (((dp_rank * ep + ep_rank) * pp +
pp_rank) * cp + cp_rank) * tp + tp_rank``. Expert parallelism (``Plan(ep=N)``) is carved out of data parallelism: the
``dp x ep`` ranks of one pipeline and TP position are the data replicas (replica ``dp_rank * ep + ep_rank``
takes that slice of the batch); the ``ep`` ranks of one dp replica split each MoE layer's experts and
exchange tokens by all-to-all. With ``ep=1`` the layout is the ``dp x pp x tp`` one it always was.

Context parallelism (``Plan(cp=N)``) splits each sequence over the ``cp`` ranks next to TP: they share their
replica's slice of the batch, each holds its own chunks of every sequence, and parameters are replicated over
them, so gradients reduce, and ZeRO shards, over the ``dp x cp`` ranks of one pipeline and TP position
(torchtitan's ``dp_shard_cp``): :meth:`MeshSpec.grad_ranks`, and :meth:`MeshSpec.shard_ranks` with ``cp > 1``.

HSDP (``Plan(dp_replicate=R)``, with ZeRO) splits the dp coordinate into ``dp_rank = replicate_rank *
(dp / R) + shard_rank`` (torchtitan's ``(dp_replicate, dp_shard)`` order, replicas outermost): the
``dp / R`` dp ranks of a shard group are neighbours in the mesh (inside a node where the mesh is laid over
nodes in rank order), the ``R`` copies of each shard are ``dp / R`` dp ranks apart. With ``cp > 1`` a shard
group is those dp ranks times every cp rank (``dp_shard = dp / R x cp``, torchtitan's ``dp_shard_cp``), and
the copies of a shard have the same cp rank.

It holds no process group, so passes, the cost model and the planner can reason about any world size on
one process (as JAX's ``AbstractMesh``); ``fxpar.runtime.groups`` turns it into a
``DeviceMesh`` and process groups.

Group names are ``"<axis>:<r0>,<r1>,..."``: the global ranks of this rank's group along an axis. The
name is the group's identity (two compiled models on the same ranks share a group; different ranks,
different names) and carries its size, which is all a fake kernel needs::

    >>> m = MeshSpec(dp=2, pp=2, tp=2, rank=5)
    >>> m.coords()
    {'dp': 1, 'pp': 0, 'tp': 1}
    >>> m.group_name("tp"), m.group_name("pp"), m.group_name("dp")
    ('tp:4,5', 'pp:5,7', 'dp:1,5')
    >>> h = MeshSpec(dp=4, tp=2, rank=6, dp_replicate=2)  # dp rank 3: replica 1, shard 1
    >>> h.shard_group_name(), h.replicate_group_name()
    ('dp_shard:4,6', 'dp_replicate:2,6')
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "ep", "pp", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class MeshSpec:
    """Degrees of a ``dp x ep x pp x cp x tp`` mesh and the rank this process stands for."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0
    ep: int = 1
    dp_replicate: int = 1  # HSDP: copies of the ZeRO-sharded state, each over dp / dp_replicate ranks
    cp: int = 1  # context parallelism: each sequence split over cp ranks

    def __post_init__(self):
        for axis in (*AXES, "dp_replicate"):
            if getattr(self, axis) < 1:
                raise ValueError(f"MeshSpec.{axis}={getattr(self, axis)}: must be >= 1")
        if self.dp % self.dp_replicate or (self.dp_replicate > 1 and self.ep > 1):
            raise ValueError(f"MeshSpec.dp_replicate={self.dp_replicate}: must divide dp={self.dp}, with ep=1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"MeshSpec.rank={self.rank}: the mesh has {self.world_size} ranks")

    @classmethod
    def for_plan(cls, plan, rank: int = 0) -> MeshSpec:
        return cls(dp=plan.dp, pp=plan.pp, tp=plan.tp, rank=rank, ep=getattr(plan, "ep", 1),
                   dp_replicate=getattr(plan, "dp_replicate", 1), cp=getattr(plan, "cp", 1))

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.pp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's degrees, outermost first: ``(dp, pp, tp)``, with ``ep`` after dp where ep > 1 and
        ``cp`` before tp where cp > 1."""
        return tuple(self.size(a) for a in self.axes)

    @property
    def axes(self) -> tuple[str, ...]:
        """The names of :attr:`shape`'s dimensions."""
        return tuple(a for a in AXES if a in ("dp", "pp", "tp") or self.size(a) > 1)

    @property
    def replicas(self) -> int:
        """Data replicas (each its own slice of the batch): ``dp * ep``."""
        return self.dp * self.ep

    @property
    def replica_rank(self) -> int:
        """This rank's data replica: ``dp_rank * ep + ep_rank``."""
        return self.dp_rank * self.ep + self.ep_rank

    def size(self, axis: str) -> int:
        return getattr(self, _axis(axis))

    # ---- rank <-> coordinates ---------------------------------------------------------------------
    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{"dp": d, "pp": p, "tp": t}`` of ``rank`` (default: this rank), and ``"ep": e`` when ep > 1."""
        r = self.rank if rank is None else rank
        inner = self.cp * self.tp
        out = {"dp": r // (self.ep * self.pp * inner), "pp": (r // inner) % self.pp, "tp": r % self.tp}
        if self.ep > 1:
            out["ep"] = (r // (self.pp * inner)) % self.ep
        if self.cp > 1:
            out["cp"] = (r // self.tp) % self.cp
        return out

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0, ep: int = 0, cp: int = 0) -> int:
        return (((dp * self.ep + ep) * self.pp + pp) * self.cp + cp) * self.tp + tp

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def ep_rank(self) -> int:
        return self.coords().get("ep", 0)

    cp_rank = property(lambda self: self.coords().get("cp", 0))

    def with_rank(self, rank: int) -> MeshSpec:
        return MeshSpec(self.dp, self.pp, self.tp, rank, self.ep, self.dp_replicate, self.cp)

    # ---- groups -----------------------------------------------------------------------------------
    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis`` (the other coordinates fixed), in order."""
        axis = _axis(axis)
        c = self.coords(rank)
        c.setdefault("ep", 0)
        c.setdefault("cp", 0)
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

    def replica_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s data replicas (same pp and tp; every dp and ep coordinate), in order:
        the group dense gradients are averaged over."""
        c = self.coords(rank)
        return [self.rank_of(d, c["pp"], c["tp"], e) for d in range(self.dp) for e in range(self.ep)]

    def replica_group_name(self, rank: int | None = None) -> str:
        """``"dpep:0,1,2,3"``: the name of :meth:`replica_ranks`' group (``group_name("dp")`` when ep=1)."""
        if self.ep == 1:
            return self.group_name("dp", rank)
        return "dpep:" + ",".join(map(str, self.replica_ranks(rank)))

    # ---- gradients: every rank holding the same parameters (the replicas, and cp inside each) ------------
    @property
    def grad_size(self) -> int:
        """Ranks a dense parameter's gradient reduces over: ``dp * ep * cp``."""
        return self.replicas * self.cp

    grad_rank = property(lambda self: self.replica_rank * self.cp + self.cp_rank)  # this rank's place in grad_ranks

    def grad_ranks(self, rank: int | None = None, experts: bool = False) -> list[int]:
        """Global ranks of ``rank``'s dense-gradient group: its replicas and, in each, every cp rank; ``experts``:
        its expert slices' group (only its ep rank: every dp and cp rank, ``dp_rank * cp + cp_rank`` in it)."""
        c = self.coords(rank)
        eps = [c.get("ep", 0)] if experts else range(self.ep)
        return [self.rank_of(d, c["pp"], c["tp"], e, k) for d in range(self.dp) for e in eps for k in range(self.cp)]

    def grad_group_name(self, rank: int | None = None, experts: bool = False) -> str:
        """The name of :meth:`grad_ranks`' group: :meth:`replica_group_name` (``experts``: ``group_name("dp")``)
        without cp, else ``"dpcp:..."``."""
        if self.cp == 1:
            return self.group_name("dp", rank) if experts else self.replica_group_name(rank)
        return "dpcp:" + ",".join(map(str, self.grad_ranks(rank, experts)))

    # ---- HSDP: the dp axis as (dp_replicate, dp_shard) ---------------------------------------------
    dp_per_shard = property(lambda self: self.dp // self.dp_replicate)  # dp ranks of a shard group (all without HSDP)

    @property
    def dp_shard(self) -> int:
        """Ranks a ZeRO shard group spans: ``dp / dp_replicate`` (``dp`` without HSDP), times ``cp``."""
        return self.dp_per_shard * self.cp

    @property
    def dp_shard_rank(self) -> int:
        """This rank's place in its shard group: which slice of each ZeRO bucket it holds."""
        return self.dp_rank % self.dp_per_shard * self.cp + self.cp_rank

    @property
    def dp_replicate_rank(self) -> int:
        """Which copy of the sharded state this rank's shard group is."""
        return self.dp_rank // self.dp_per_shard

    def shard_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s shard group (same replica, pp and tp coordinates; every cp rank), in order."""
        if self.cp > 1 and self.dp_replicate == 1:
            return self.grad_ranks(rank)
        c, n = self.coords(rank), self.dp_per_shard
        first = c["dp"] // n * n
        return [self.rank_of(first + s, c["pp"], c["tp"], c.get("ep", 0), k) for s in range(n) for k in range(self.cp)]

    def replicate_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks holding the same ZeRO shards as ``rank`` (its copies across replicas), in order."""
        if self.dp_replicate == 1:
            return [self.rank if rank is None else rank]
        c, n = self.coords(rank), self.dp_per_shard
        return [self.rank_of(r * n + c["dp"] % n, c["pp"], c["tp"], cp=c.get("cp", 0))
                for r in range(self.dp_replicate)]

    def shard_group_name(self, rank: int | None = None) -> str:
        """ZeRO's group: ``group_name("dp")`` (:meth:`grad_group_name` with cp), with HSDP ``"dp_shard:<ranks>"``."""
        if self.dp_replicate == 1:
            return self.grad_group_name(rank) if self.cp > 1 else self.group_name("dp", rank)
        return "dp_shard:" + ",".join(map(str, self.shard_ranks(rank)))

    def replicate_group_name(self, rank: int | None = None) -> str:
        """``"dp_replicate:<ranks>"``: the copies of ``rank``'s shards (one rank without HSDP)."""
        return "dp_replicate:" + ",".join(map(str, self.replicate_ranks(rank)))

    def pipeline_ranks(self) -> list[int]:
        """The global rank of each pipeline position in this rank's pipeline (same dp and tp)."""
        return self.axis_ranks("pp")

    def __str__(self) -> str:
        ep = f" x ep={self.ep}" if self.ep > 1 else ""
        ep += f" x cp={self.cp}" if self.cp > 1 else ""
        ep += f" (dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard})" if self.dp_replicate > 1 else ""
        return f"mesh dp={self.dp}{ep} x pp={self.pp} x tp={self.tp} (rank {self.rank}: {self.coords()})"


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}")
    return axis
