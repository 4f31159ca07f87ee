"""What a rank holds: the one ZeRO / DP memory model (:func:`state_bytes`, read by ``compiled.memory()``
and the planner alike), and the moments of a pipeline schedule at which a rank's memory can peak, and the
peaks they give.

A rank's activation memory at a moment is what its live microbatches keep for backward, plus the
transient of a backward running then (recomputed forward, gradients alive at once), plus the program's
outputs made so far (every microbatch's are kept to the step's end); the gradients of the parameters
exist from a stage's first backward on. GPipe's peak is at its first backward, before any gradient;
1F1B's later backwards hold as many microbatches and the gradients too. Used by
:mod:`fxpar.planner.price`; cached per schedule, pipeline size, microbatches and virtual stages.
:func:`per_rank` walks each pipeline rank's states, activations, buffers and optimizer step to the
fullest rank, with the data-parallel time each leaves exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.cost.data_parallel import DpGroups, engine_times
from fxpar.cost.overheads import comm_share
from fxpar.cost.schedule import moments, peak_activation
from fxpar.ir.plan import Plan
from fxpar.ir.quant_ops import HELD_BYTES
from fxpar.ir.resolved import DEFAULT_BUCKET_BYTES, microbatch_size
from fxpar.ir.schedule import schedule_record

__all__ = ["ADAM_BYTES", "ADAM_STATES", "BUCKET", "RankSums", "activation_peaks", "fit_bound", "fused_saving",
           "moments", "optimizer_transient", "per_rank", "state_bytes", "step_grads"]

ADAM_STATES = 2
ADAM_BYTES = 28  # AdamW per fp32 entry: reads param, grad, 2 states; writes param, 2 states
BUCKET = DEFAULT_BUCKET_BYTES  # the data-parallel engine's gradient bucket


def state_bytes(numel: int, zero: int, dp: int, states: int, dp_replicate: int = 1, frozen: int = 0,
                frozen_bytes: float = 4.0) -> dict[str, int]:
    """Bytes one rank holds between steps for ``numel`` trainable fp32 parameter entries of its stages:
    ZeRO-1/2 add an fp32 master shard; ZeRO-2 keeps gradient shards only (plus full gradients of the
    step in flight: :func:`step_grads`); ZeRO-3 keeps shards of everything (``runtime/zero3.py``: after
    compile only its shards); ``states`` optimizer states per entry.
    ``dp_replicate`` (HSDP): the shards are over ``dp / dp_replicate`` ranks, each held by that many replicas.
    ``frozen``: entries more that do not train (``requires_grad=False``: a LoRA's base), weights alone: no
    gradient, master shard or optimizer state (``runtime/model.py``), sharded by ZeRO-3 in buckets of their own;
    ``frozen_bytes`` each (QLoRA's blocks: :data:`fxpar.ir.quant_ops.HELD_BYTES`, the norms priced alike)."""
    n, dp = numel, dp // dp_replicate
    return {"params": 4 * n // dp if zero == 3 else 4 * n + (4 * n // dp if zero in (1, 2) else 0),
            "grads": 4 * n // dp if zero >= 2 else 4 * n + (4 * n // dp if zero == 1 else 0),
            "optimizer": 4 * states * n // (dp if zero >= 1 else 1),
            "frozen": int(frozen_bytes * frozen) // (dp if zero == 3 else 1)}


def step_grads(numel: int, zero: int, microbatches: int) -> int:
    """Gradient bytes a rank holds during a step beyond :func:`state_bytes`'s: ZeRO-2 with several
    microbatches accumulates its ``numel`` entries' gradients whole over them (``runtime/data_parallel.py``
    reduce-scatters them once, after the last)."""
    return 4 * numel if zero == 2 and microbatches > 1 else 0


def activation_peaks(name: str, pp: int, m: int, v: int, mine, kept, trans, kout, params, exact: bool) -> list[tuple]:
    """Per rank: its activation peak (kept microbatches, the backward's transient, the outputs made so
    far), its peak counting also the parameter gradients (4 bytes per entry) its backwards have made
    by then, and its peak while no backward runs, at every moment of its schedule
    (:func:`fxpar.cost.schedule.moments`); above the exact limit, the in-flight bound with every microbatch's
    outputs and, but for GPipe, the gradients held through the steady state (and the first as the third)."""
    if not exact:
        all_forwards_first = schedule_record(name).closed_forms[1] == "gpipe"  # no gradient before the last forward
        base = peak_activation(name, pp, m, v, [[kept[s] for s in st] for st in mine],
                               [[trans[s] for s in st] for st in mine], exact=False)
        out = []
        for r, st in enumerate(mine):
            a, g = base[r] + m * sum(kout[s] for s in st), 4 * sum(params[s] for s in st)
            out.append((a, max(a, g + m * sum(kout[s] for s in st)) if all_forwards_first else a + g, a))
        return out
    out = []
    for r, st in enumerate(mine):
        got = [0.0, 0.0, 0.0]
        grads = [4 * params[s] for s in st]
        for live, t, done, fwd in moments(name, pp, m, v)[r]:
            a = sum(c * kept[s] + f * kout[s] for c, f, s in zip(live, fwd, st)) + (trans[st[t]] if t >= 0 else 0)
            got = [max(got[0], a), max(got[1], a + sum(g for d, g in zip(done, grads) if d)),
                   got[2] if t >= 0 else max(got[2], a)]
        out.append(tuple(got))
    return out


@dataclass(frozen=True)
class RankSums:
    """Per pipeline rank, sums over the stages it runs (``mine``) of a plan's per-stage figures: parameter
    entries (``n``, frozen ones included), frozen entries (``frozen``), expert slices (``experts``), and the
    largest part (``part``: ZeRO-3's bucket) and tensor (``tensor``) it steps. Plans of one stage layout
    share them (:class:`fxpar.cost.estimate.Pricer` keeps them with the stages)."""

    n: tuple
    frozen: tuple
    experts: tuple
    part: tuple
    tensor: tuple
    part_head: tuple = ()  # ``part`` where ZeRO-3 leaves the fused loss's head on its shards (passes/zero3.py),
    # the embedding's bucket apart (gathered at the forward's start only)
    pre: tuple = ()  # the embedding part's entries ("pre")
    head: object = None  # that head (fxpar.planner.variants.HeadOnShards; None: none)

    @classmethod
    def of(cls, st: dict, mine, head=None) -> RankSums:
        """From a Pricer's per-stage figures ``st`` (``params``, ``frozen``, ``eparams``, ``big``, ``bigt``,
        ``bigh``, ``pre``); ``head``: the head ZeRO-3 may leave on its shards (``zero3_times.shard_head``)."""
        def total(key):
            return tuple(sum(st[key][s] for s in r) for r in mine)

        def most(key):
            return tuple(max(st[key][s] for s in r) for r in mine)
        return cls(total("params"), total("frozen"), total("eparams"), most("big"), most("bigt"), most("bigh"),
                   most("pre"), head)

    def on_shards(self, shard: int) -> bool:
        """Whether ZeRO-3 over ``shard`` ranks leaves the fused loss's head on its shards."""
        return self.head is not None and self.head.applies(shard)

    def gathered(self, r: int, shard: int) -> int:
        """The largest bucket ZeRO-3 holds gathered beside pipeline rank ``r``'s activations over a shard group
        of ``shard`` ranks."""
        return self.part_head[r] if self.on_shards(shard) else self.part[r]


def per_rank(p, plan: Plan, m: int, ranks: RankSums, hidden, acts, groups: DpGroups, gbytes: float,
             experts=None) -> tuple:
    """Over the pipeline ranks: the data-parallel time left exposed after the last microbatch's backward
    (buckets reduce as they fill; ZeRO-1/2 then gather the updated shards), the optimizer step, and the
    fullest rank's memory ``(peak, states, activations, buffers)``.

    ``ranks``: the ranks' parameter entries and largest tensors (:class:`RankSums`); ``hidden[r]``: the rank's
    backward seconds per microbatch, behind which its buckets reduce (None: none hide; the memory does not
    read it). ``acts[r]``: the rank's peak of activations without and with the gradients its backward makes,
    and while no backward runs (:func:`activation_peaks`). The step drops the parameters' gradients when it
    begins (``runtime/model.py``), so without data parallelism they are not there at the activations' peak;
    the data-parallel engine keeps its flat buckets (the gradients between steps are views of them:
    ``runtime/data_parallel.py``) and autograd's fresh gradients are copied into them as backward makes
    them. ZeRO-2 frees each bucket's full gradients when it goes out (its flat buckets, made each step,
    take their place); ZeRO-3 reduce-scatters each bucket's gradient at once and keeps one gathered
    bucket (the last of the forward, for the backward that starts with it). At the optimizer step the
    activations are gone and every gradient is there, with the optimizer's temporaries
    (:func:`optimizer_transient`).

    Frozen entries (``ranks.frozen``, a LoRA's base) are weights alone (:func:`state_bytes`): no gradient,
    no reduction, no optimizer step.

    ``experts`` (expert parallelism): the expert slices' dp group: ``ranks.experts`` of the entries reduce and
    shard over it (``runtime/model.py``'s ``make_engine``), the rest over ``groups``; ``plan.dp`` is then the
    ``dp x ep`` replicas."""
    dp, pp = plan.dp, plan.pp
    dp_exposed = opt_time = 0.0
    # collectives slowed by ranks computing beside them
    slow = comm_share(p, min(plan.world_size, p.ranks_per_node), dp)
    worst: tuple = ()
    per_n: dict[int, tuple] = {}  # ranks holding equal parameter counts share their collectives
    for r in range(pp):
        fz = ranks.frozen[r]
        n = ranks.n[r] - fz  # trainable entries
        ne = ranks.experts[r] if experts is not None else 0
        got = per_n.get((n, ne, fz))
        if got is None:
            red, last, gather = engine_times(p, plan.zero, n - ne, groups, BUCKET) if dp > 1 else (0.0, 0.0, 0.0)
            mem = state_bytes(n - ne, plan.zero, dp, ADAM_STATES, plan.dp_replicate, fz, HELD_BYTES[plan.base_dtype])
            stepped = (n - ne) // groups.shard if plan.zero else n - ne
            if ne:  # the expert slices: their own buckets after the dense ones, sharded over their group
                g = experts
                red, last, gather = (x + y for x, y in zip((red, last, gather),
                                                           engine_times(p, plan.zero, ne, g, BUCKET)))
                mem = {k: v + state_bytes(ne, plan.zero, g.shard, ADAM_STATES)[k] for k, v in mem.items()}
                stepped += ne // g.shard if plan.zero else ne
            red, last, gather = red / slow, last / slow, gather / slow  # the dense and the expert buckets alike
            mem["grads"] += step_grads(n, plan.zero, m)
            opt = p.optimizer_time(stepped, ADAM_BYTES)
            got = per_n[(n, ne, fz)] = (red, last, gather, mem, sum(mem.values()), opt)
        red, last, gather, mem, held, opt = got
        if dp > 1:  # (ZeRO-3's gathers are in B; with HSDP its shards' all-reduce follows the backward)
            hide = hidden[r] if p.comm_overlaps and hidden is not None else 0.0
            dp_exposed = max(dp_exposed, max(0.0, red - hide) + (last if p.comm_overlaps else 0.0) + gather)
        opt_time = max(opt_time, opt)
        buffers, made, bucket, gather_peak = 0, True, 0, 0  # made: whether backward's gradients add to the state
        trains = n / max(1, n + fz)  # the share of a bucket or a tensor that has gradients and optimizer state
        if plan.zero == 3 and dp > 1:
            part = ranks.gathered(r, groups.shard)
            buffers, made = part * gbytes, False
            # a gather of the largest bucket late in a forward (an LM head's): what the backend holds beside
            # it while gathering (gloo: as much again) on top of the forward's activations
            gather_peak = held - mem["grads"] + buffers * (1 + p.gather_scratch) + acts[r][2]
            if ranks.on_shards(groups.shard):  # the embedding's gather as the forward starts, the next prefetched
                gather_peak = max(gather_peak, held - mem["grads"] + (ranks.pre[r] * (1 + p.gather_scratch) +
                                                                      part) * gbytes)
            # a bucket's backward: the regathered bucket, its parameters' gradients and their concatenation
            # (then gloo's reduce-scatter copy of it) alive at once; at the last bucket's, every other
            # shard's gradient is made
            bucket = held + (gbytes + 8 * trains) * ranks.part[r]  # (the embedding's too: its gradient is whole)
        elif plan.zero == 2 and dp > 1 and m > 1:
            made = False  # accumulated whole over the microbatches (counted in the state)
        # gradients held as the step begins: the step drops its stages' parameters' .grad before the forward
        # (ZeRO-3: the shards'); the engine's buckets and ZeRO-1/2's shard gradients stay
        before = 0 if dp == 1 and plan.zero == 0 or plan.zero == 3 else mem["grads"]
        total = max(held - mem["grads"] + before + buffers + acts[r][made], bucket, gather_peak)
        stepped = ranks.part[r] if plan.zero == 3 else ranks.tensor[r]
        stepped = int(stepped * trains)  # (a LoRA's largest stepped tensor: roughly its adapters' share)
        total = max(total, held + optimizer_transient(p, plan.zero, n, stepped, groups.shard if plan.zero else 1))
        if not worst or total > worst[0]:
            worst = (total, mem, acts[r][0], buffers)
    return dp_exposed, opt_time, worst


def optimizer_transient(p, zero: int, n: int, largest: int, shard: int) -> int:
    """Bytes AdamW allocates for the step on top of its states, for ``n`` fp32 entries a rank steps whose
    largest tensor has ``largest`` entries before sharding (a parameter; ZeRO-3: a layer's bucket; ZeRO-1/2:
    the engine's gradient bucket, at least ``BUCKET``), ``shard`` ranks sharing each: torch's per-tensor
    path (the CPU's) makes two temporaries of the tensor it steps (``exp_avg_sq.sqrt()`` and its quotient),
    its multi-tensor path (CUDA's default) one of every stepped tensor at once."""
    if not p.optimizer_per_tensor:
        return 4 * n // shard
    if zero in (1, 2):
        largest = max(largest, BUCKET // 4)
    return 2 * 4 * -(-largest // shard)


def fused_saving(pricer, plan: Plan) -> tuple[float, float]:
    """At most the bytes and the seconds ``Plan(fused_loss=True)`` saves ``plan`` (priced by ``pricer``, a
    :class:`fxpar.cost.estimate.Pricer`): bytes, all that the unfused "post" part (head and loss) keeps,
    its backward's transient and the outputs it keeps to the step's end for every microbatch; seconds, the
    unfused part's forward and backward for every microbatch. Bounds read without the fused part, so the
    search knows whether pricing the fused loss can make a plan fit or win."""
    from fxpar.ir.schedule import microbatches

    m = microbatches(plan)
    b = microbatch_size(pricer.batch, plan.replicas, m)
    post = pricer.costs.part("post", plan.tp, plan.sequence_parallel)
    kept, trans = max(post.act.values(), key=sum, default=(0, 0))
    k = pricer.kind("post", plan.tp, plan.sequence_parallel, b, plan.recompute, plan.world_size, pricer.dtype(plan))
    return b * (kept + trans + post.grad_bytes) + m * b * post.kept_out, m * (k[0] + k[1])


def fit_bound(pricer, plan: Plan) -> float:
    """The most memory per rank ``plan`` may price at and still fit, or be made to by the fused loss (at most
    :func:`fused_saving`'s bytes less): above it a search needs none of its times (``Pricer.price(times_up_to=)``)."""
    return pricer.memory + (fused_saving(pricer, plan)[0] if pricer.costs.fused is not None else 0)
