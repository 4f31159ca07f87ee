"""Data parallelism and ZeRO stages 1-2 for the parameters one rank holds.

Every data-parallel rank runs the same stages on its slice of the global batch; the loss of each
microbatch is already weighted by its share of the global batch's tokens, so gradients are *summed*
over the dp group (no division).

* zero=0 (DDP): gradients are flattened into buckets (in the order backward produces them, up to
  ``bucket_bytes``; the first bucket, the last layers', up to 1 MiB as torch DDP's, so that its
  reduction starts early) and each bucket is all-reduced asynchronously as soon as all of its
  gradients are final, while backward still runs. When a gradient is final is learned in the first
  step of each program (how many times autograd accumulates into each parameter per step, which
  depends on microbatches and schedule); that step reduces after backward. Each gradient is copied
  into its bucket the moment it is final, and the bucket is kept from step to step: after the
  reduction the parameters' ``.grad`` are views of it (torch DDP's ``gradient_as_bucket_view``), so a
  step makes one copy of every gradient and allocates no bucket.
* zero=1: the same reductions; each rank's optimizer holds only its shard of every bucket (a flat fp32
  parameter, so optimizer states are 1/dp), updates it, and the updated shards are all-gathered
  back into the parameters.
* zero=2: as zero=1, but each bucket is reduce-scattered and the full gradients are freed as soon as
  the bucket is launched: gradients held are 1/dp too.
* ``offload`` (ZeRO-1/2): the fp32 shards and the optimizer states live in CPU memory (ZeRO-Offload);
  each bucket's gradient shard is copied there, the optimizer steps on the CPU, and the updated shard
  goes back to the device for the all-gather.
* zero=3: parameters are shards already (``fxpar.passes.zero3``); the gathers' backward reduce-scatters
  the gradients, so the optimizer steps the shards directly (the regathering for backward is
  ``fxpar.runtime.zero3``'s).
* HSDP (``Plan(dp_replicate=R)``; ``replicate=`` here): buckets shard over the shard group (``dp`` is its
  size, ``group`` its name) and every shard has ``R`` copies, one per replica group. Traffic inside the
  shard group is a full bucket per collective, across replicas only a shard (1/dp of it), which is why
  the shard groups are the ranks inside a node. The collectives of a step, per stage:
  zero=3: the graph's gathers and reduce-scatters inside the shard group, then each shard's gradient
  all-reduced across the replicas (:meth:`finish`).
  zero=2: each bucket reduce-scattered inside the shard group as it fills (gloo, which has no
  reduce-scatter, all-reduces and slices: the same result, twice the traffic), each shard all-reduced
  across the replicas, the updated shards all-gathered inside the shard group.
  zero=1: as zero=2, plus the reduced shards all-gathered back into the whole bucket inside the shard
  group before the step: ZeRO-1 keeps the whole, fully reduced gradients as without HSDP (the parameters'
  ``.grad`` are views of the bucket). That is a hierarchical all-reduce (the replicas exchange 1/dp of
  the bucket instead of all of it, as a flat all-reduce over every dp rank would).

Buckets use the flat layout of :class:`~fxpar.ir.buckets.FlatBucket`, the one ZeRO-3's buckets use.
With optimizer parameter groups (:class:`~fxpar.ir.optim.ParamGroups`) a bucket holds one group's
parameters only (a new bucket starts where the group changes), so each ZeRO-1/2 flat shard lies in one
group; the factory gets every group of the model, in order, empty ones included.

Flat shards work only for optimizers whose update is elementwise per parameter entry (SGD, Adam,
AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam): ZeRO refuses others before any communication.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from fxpar.ir.buckets import FlatBucket
from fxpar.ir.optim import ParamGroups, check_optimizer, make_optimizer
from fxpar.ir.resolved import DEFAULT_BUCKET_BYTES
from fxpar.runtime import dist_calls
from fxpar.runtime.collectives import _backend_of as backend_of
from fxpar.runtime.groups import resolve_group


class _Bucket(FlatBucket):
    """A gradient bucket: the flat layout of its parameters, the parameters, and the step's state."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], dp: int, rank: int, keep: bool):
        super().__init__([n for n, _ in params], [p.shape for _, p in params], dp)
        self.params = [p for _, p in params]
        self.rank = rank  # this rank's index in the group the bucket shards over
        self.lo, self.hi = self.shard_range(rank)
        self.keep = keep  # the flat buffer lives from step to step (zero=0/1; zero=2 frees it)
        self.work = None  # the async collective in flight
        self.part: torch.Tensor | None = None  # HSDP: this rank's reduced shard of the gradients (or None)
        self.flat: torch.Tensor | None = None  # the gradients, flat (padding zero)
        self.filled: set[int] = set()  # positions whose gradient is in ``flat`` this step
        self.waiting = 0  # gradients still to become final before the bucket can go
        self.shard: torch.nn.Parameter | None = None
        self.group = ""  # the name of the group its gradients are reduced over (set by the engine)

    def master_shard(self) -> torch.Tensor:
        """A new fp32 copy of this rank's shard of the parameters' values (padding zero), packed in one
        launch (``fxpar_kernels::pack_shard``: Triton on CUDA, torch's copy-in elsewhere) without making
        the whole flat bucket."""
        from fxpar.runtime.kernels import buckets  # on first use: the kernels module loads triton

        with torch.no_grad():
            return buckets.pack_shard([p.data for p in self.params], self.dp, self.rank, torch.float32)

    def fill(self, i: int) -> None:
        """Copy parameter ``i``'s gradient (zeros if it has none) into its place in the flat buffer."""
        if self.flat is None:
            p0 = self.params[0]
            self.flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        piece = self.flat[self.offsets[i]:self.offsets[i] + self.numels[i]]
        g = self.params[i].grad
        if g is None:
            piece.zero_()
        else:
            piece.copy_(g.detach().reshape(-1))
        self.filled.add(i)

    def scatter_into(self, flat: torch.Tensor) -> None:
        """The parameters' values from ``flat`` (the gathered fp32 shards), each cast to its own dtype, in
        one launch (``fxpar_kernels::copy_out``: torch's split copy unless :func:`fxpar.runtime.kernels.use_triton`
        asks for Triton; on CUDA Triton measured 0.98x torch's, so "auto" keeps torch's)."""
        from fxpar.runtime.kernels import buckets  # on first use: the kernels module loads triton

        with torch.no_grad():
            buckets.copy_out(flat, [p.data for p in self.params])


class DataParallelEngine:
    """Gradient synchronisation and the optimizer step over one dp group, for this rank's parameters."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], optimizer_factory, *, dp: int,
                 rank: int, zero: int, group: str = "dp", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 overlap: bool = True,
                 offload: bool = False, first_bucket_bytes: int | None = None,
                 param_groups: ParamGroups | None = None, group_of: dict[int, int] | None = None,
                 reduce_group=None, replicate: tuple[str, int] | None = None):
        """``param_groups``: the model's groups; ``group_of``: id(parameter) -> its group (with them).
        ``reduce_group``: parameter -> ``(group name, size, this rank's index)`` it is reduced over, where
        that is not ``(group, dp, rank)`` (expert parallelism: an expert slice over dp only); buckets
        never mix reduction groups, each shards over its own. ``replicate``: HSDP's ``(group name, size)``
        of the copies of this rank's shards (``dp`` and ``group`` are then the shard group's)."""
        self.dp, self.rank, self.zero, self.group = dp, rank, zero, group
        self.replicate = replicate if replicate is not None and replicate[1] > 1 else None
        self.overlap = overlap  # (offload with zero other than 1 or 2 is refused by Plan itself)
        self.home = torch.device("cpu") if offload else None  # where shards and optimizer states live
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named]
        group = (lambda p: group_of[id(p)]) if param_groups is not None else (lambda p: 0)
        red = reduce_group or (lambda p: (self.group, dp, rank))
        self.buckets: list[_Bucket] = []
        if zero < 3:
            # torch DDP's first-bucket cap (1 MiB): the first gradients backward makes go out at once
            first = min(bucket_bytes, getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)
                        if first_bucket_bytes is None else first_bucket_bytes)
            sharded = zero in (1, 2)  # only flat shards need one group per bucket (DDP steps whole parameters)

            def key(p):  # a bucket holds one optimizer group (flat shards) and one reduction group
                return (group(p) if sharded else 0, red(p)[0])
            self.buckets = [_Bucket(ps, *red(ps[0][1])[1:], keep=zero < 2)
                            for ps in bucket_params(named, first, bucket_bytes, key)]
            for b in self.buckets:
                b.group = red(b.params[0])[0]
        self.slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        if zero in (1, 2):
            for b in self.buckets:
                b.shard = torch.nn.Parameter(b.master_shard().to(self.home or b.params[0].device))
            self.optimizer = make_optimizer(optimizer_factory, [b.shard for b in self.buckets], param_groups,
                                            [group(b.params[0]) for b in self.buckets])
        else:
            self.optimizer = make_optimizer(optimizer_factory, self.params, param_groups, list(map(group, self.params)))
        if self.optimizer is not None:
            check_optimizer(self.optimizer, zero)
        # payload bytes in the last step (the full tensor each collective works on)
        self.comm: dict[str, int] = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
        # fxpar_kernels this engine launches (fxpar inspect lists them): the master shards' copy-in (once),
        # the updated shards' copy-out
        self.kernels: tuple[str, ...] = ("pack_shard",) * (zero in (1, 2)) + ("copy_out",) * (zero in (1, 2) and dp > 1)
        self.counts: dict[int, int] = {}
        self.expected: dict[int, int] | None = None  # the current program's, learned on its first step
        self.learned: dict[object, dict[int, int]] = {}  # program key -> gradients per parameter per step
        self.key = None
        self.hooks = []
        if zero < 3 and (dp > 1 or self.replicate):
            me = weakref.ref(self)  # the hooks must not keep an engine alive (a model compiled again)

            def on_grad(p, me=me):
                engine = me()
                if engine is not None:
                    engine._on_grad(p)
            for p in self.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(on_grad))

    def close(self) -> None:
        """Remove the gradient hooks from the parameters (also done when the engine is collected)."""
        for h in getattr(self, "hooks", ()):  # an engine whose __init__ raised has none yet
            h.remove()
        self.hooks = []

    def __del__(self):
        self.close()

    # ---- during backward --------------------------------------------------------------------------
    def start_step(self, key=None) -> None:
        """A new step of the program ``key`` (each program learns its own gradient counts)."""
        self.counts = {id(p): 0 for p in self.params}
        self.comm = dict.fromkeys(self.comm, 0)
        self.key = key
        self.expected = self.learned.get(key)
        for b in self.buckets:
            b.work, b.filled = None, set()
            if not b.keep:
                b.flat = None
            if self.expected is not None:
                b.waiting = sum(self.expected[id(q)] > 0 for q in b.params)

    def _on_grad(self, p: torch.Tensor) -> None:
        n = self.counts[id(p)] = self.counts.get(id(p), 0) + 1
        if not self.overlap or self.expected is None or n != self.expected[id(p)]:
            return
        b, i = self.slot[id(p)]  # p's gradient is final: into the bucket now, while backward goes on
        if b.work is not None:
            return  # (more gradients than learned: finish raises)
        b.fill(i)
        b.waiting -= 1
        if b.waiting == 0:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        for i in range(len(b.params)):
            if i not in b.filled:  # the gradients not copied at their hook (first step, no overlap, none)
                b.fill(i)
        if self.replicate is not None:  # HSDP: reduce-scatter inside the shard group, replicas in finish
            b.work, b.part = _reduce_scatter(b) if b.dp > 1 else (_DONE, b.flat)
            self.comm["reduce_scatter"] += b.flat.numel() * b.flat.element_size() if b.dp > 1 else 0
        elif b.dp == 1:  # nothing to reduce
            b.work = _DONE
        else:
            b.work = dist_calls.all_reduce(b.flat, b.group, async_op=True)
            self.comm["all_reduce"] += b.flat.numel() * b.flat.element_size()
        if self.zero == 2:  # the bucket holds the gradients now; the full ones go
            for p in b.params:
                p.grad = None

    # ---- after backward ---------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for (or issue) every bucket's reduction and leave each gradient where the optimizer reads it."""
        if self.zero == 3:
            if self.replicate is not None:  # HSDP: the shard gradients the graph reduce-scattered, across copies
                self._all_reduce_replicas([p.grad for p in self.params if p.grad is not None])
            return
        if self.dp == 1 and self.zero == 0:
            return  # (ZeRO-1/2 at dp=1, e.g. pp x tp on every rank: the gradients still go to the flat shards)
        if self.expected is None:
            self.expected = self.learned[self.key] = dict(self.counts)
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        if self.replicate is not None:
            self._finish_hsdp()
        for b in self.buckets:
            b.work.wait()
            if self.zero < 2:  # the parameters' gradients are views of the reduced bucket
                for p, piece in zip(b.params, b.views(b.flat)):
                    p.grad = piece
            if self.zero > 0:  # gloo has no reduce-scatter: the all-reduced bucket, sliced (NCCL would scatter)
                part = b.part if b.part is not None else b.flat[b.lo:b.hi]
                b.shard.grad = part.float().to(b.shard.device, copy=True)
            b.work = b.part = None
            if not b.keep:
                b.flat = None
        late = [p for p in self.params if self.counts[id(p)] > self.expected[id(p)]] if self.overlap else []
        if late:  # a gradient accumulated after its bucket went: the reduced gradients would miss it
            raise RuntimeError(
                f"fxpar.runtime.data_parallel: {len(late)} parameter(s) (shapes {[tuple(p.shape) for p in late[:3]]}) "
                f"got {[self.counts[id(p)] for p in late[:3]]} gradients this step, more than the "
                f"{[self.expected[id(p)] for p in late[:3]]} learned on the first step of this program; the "
                "schedule's gradient count must not change between steps of one program")

    def _finish_hsdp(self) -> None:
        """HSDP, after backward: every bucket's reduce-scattered shard all-reduced across the replicas (all in
        flight at once); ZeRO-1 then gathers the reduced shards back into the whole bucket (shard group)."""
        for b in self.buckets:
            b.work.wait()
            b.work = _DONE
            if b.part is None:  # gloo: the shard group's all-reduced bucket, this rank's slice
                b.part = b.flat[b.lo:b.hi].clone()
        self._all_reduce_replicas([b.part for b in self.buckets])
        if self.zero == 1:
            for b in self.buckets:
                if b.dp > 1:
                    dist_calls.all_gather_into(b.flat, b.part, b.group)
                    self.comm["all_gather"] += b.flat.numel() * b.flat.element_size()

    def _all_reduce_replicas(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` (this rank's shard gradients) over the replica group, in place, all in flight at once."""
        pg = resolve_group(self.replicate[0])
        works = [dist_calls.all_reduce(t, pg, async_op=True) for t in tensors]
        self.comm["all_reduce"] += sum(t.numel() * t.element_size() for t in tensors)
        for w in works:
            w.wait()

    def step(self) -> None:
        """:meth:`finish`, then :meth:`update` (the compiled model calls them apart to clip in between)."""
        self.finish()
        self.update()

    def update(self) -> None:
        """The optimizer step on the synchronised gradients; ZeRO-1/2 gather the updated shards back."""
        if self.optimizer is None:
            return
        self.optimizer.step()
        if self.zero in (1, 2):
            for b in self.buckets:
                device = b.params[0].device  # gathered where the parameters live (back from CPU if offloaded)
                if b.dp == 1:  # the shard is the whole bucket
                    b.scatter_into(b.shard.detach().to(device))
                    continue
                pg = resolve_group(b.group)
                full = torch.empty(b.shard_numel * b.dp, dtype=b.shard.dtype, device=device)
                dist_calls.all_gather_into(full, b.shard.detach().to(device), pg)
                self.comm["all_gather"] += full.numel() * full.element_size()
                b.scatter_into(full)

    # ---- reading ----------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (now)."""
        return held_bytes(self.params, self.optimizer, [b.shard for b in self.buckets if b.shard is not None])


def bucket_params(named: list, first: int, bucket_bytes: int, group=None) -> list[list]:
    """``named`` (name, parameter) in buckets, in the order backward makes the gradients (the last layers'
    first): a bucket closes at ``bucket_bytes`` (the first one at ``first``) or where the dtype changes.
    ``group`` (parameter -> optimizer group): each group fills buckets of its own, side by side, so a
    bucket holds one group only without cutting the others' buckets at every change of group."""
    out: list[list] = []
    open_: dict[int, tuple[list, list]] = {}  # group -> (its open bucket, [bytes in it, its cap])
    for name, p in reversed(named):
        g = group(p) if group is not None else 0
        nbytes = p.numel() * p.element_size()
        cur = open_.get(g)
        if cur is None or cur[0] and (cur[1][0] + nbytes > cur[1][1] or p.dtype != cur[0][0][1].dtype):
            cur = open_[g] = ([], [0, first if not out else bucket_bytes])
            out.append(cur[0])
        cur[0].append((name, p))
        cur[1][0] += nbytes
    return out


def _reduce_scatter(b: _Bucket) -> tuple[object, torch.Tensor | None]:
    """Start reducing bucket ``b``'s gradients inside its (shard) group: (work handle, the shard it fills, or
    None where gloo, which has no reduce-scatter, all-reduces the whole bucket and the shard is its slice)."""
    pg = resolve_group(b.group)
    if backend_of(pg, b.flat.device) == "gloo":
        return dist_calls.all_reduce(b.flat, pg, async_op=True), None
    part = b.flat.new_empty(b.shard_numel)
    return dist_calls.reduce_scatter_into(part, b.flat, pg, async_op=True), part


class _Done:
    """The work handle of a reduction that needs no communication (dp=1)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


def held_bytes(params, optimizer, shards=()) -> dict[str, int]:
    """Bytes held now by ``params`` and ``shards`` (flat ZeRO shards), their gradients and the
    optimizer's tensor states; each tensor counted once."""
    seen = set()

    def nbytes(ts):
        total = 0
        for t in ts:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total
    states = [v for s in (optimizer.state.values() if optimizer else []) for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": nbytes(params) + nbytes(shards),
            "grads": nbytes([p.grad for p in params]) + nbytes([s.grad for s in shards]),
            "optimizer": nbytes(states)}
