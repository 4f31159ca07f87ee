"""HSDP (``Plan(dp_replicate=R)``) on 8 gloo ranks against one process: ZeRO-1/2/3 sharded inside groups
of dp / R ranks and replicated R times, alone and with TP and PP. Losses, every parameter after AdamW
steps and the clipped gradient norm equal the single-process run's; each collective's bytes, tapped at
torch.distributed per process group, equal the theory (the shard group gathers and reduce-scatters whole
buckets, the replica group all-reduces one shard); checkpoints saved under HSDP load bitwise under a flat
plan, and the other way round, on every replica."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar import checkpoint, zoo
from fxpar.cost import comm
from fxpar.ir.ops import gather_params_op, parse_ranks
from fxpar.report.budget import trainable
from fxpar.runtime import data_parallel
from fxpar.runtime.state import local_state
from fxpar.testing import multiproc

TOL = 1e-5
NAME = "llama"
MAX_NORM = 0.05  # below every step's gradient norm (asserted), so the clipping really scales
pool8 = multiproc.rank_pool(8)
pytestmark = pytest.mark.slow


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _batch():
    return zoo.example_inputs(NAME, zoo.tiny_config(NAME), batch=8, seq=8)


class CommTap(TorchDispatchMode):
    """Payload bytes of every collective issued while active, per (group's ranks, collective): the
    all-reduced tensor, the gathered output, the reduce-scattered input. fxpar's collective ops (ZeRO-3's
    gathers and their backward's reduce-scatters, TP's) are seen as themselves, with the group their name
    lists (the c10d calls inside their kernels run with the mode off); the engine's own torch.distributed
    calls as c10d ops, with their process group's ranks."""

    # on gloo fxpar all-gathers by one broadcast per member into the output's slices
    # (fxpar.runtime.dist_calls.gather_by_broadcasts): their payloads add up to the gathered output
    C10D = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_": "all_gather",
            "broadcast_": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter"}
    FXPAR = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_rs_bwd": "all_gather",
             "gather_params": "all_gather", "reduce_scatter": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.bytes: dict[tuple[tuple[int, ...], str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if func.namespace == "fxpar" and name in self.FXPAR:
            op, ranks = self.FXPAR[name], parse_ranks(args[1])
            t = out if op == "all_gather" else args[0]
        elif func.namespace == "c10d" and name in self.C10D:
            op = self.C10D[name]
            pg = next(a for a in args if isinstance(a, torch.ScriptObject))
            ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg)))
            t = args[0] if op != "reduce_scatter" else args[1]
        else:
            return out
        n = sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
        self.bytes[(ranks, op)] = self.bytes.get((ranks, op), 0) + n
        return out


def _by_group(tap: CommTap, spec) -> dict[str, int]:
    """The tap's bytes on this rank's shard and replica groups: ``"shard all_gather"``, ... (the engine's
    reduce-scatter shows as the all-reduce of the whole bucket gloo runs for it: gloo has none)."""
    names = {tuple(spec.shard_ranks()): "shard", tuple(spec.replicate_ranks()): "replicate"}
    return {f"{names[r]} {op}": n for (r, op), n in tap.bytes.items() if r in names}


def _theory(compiled, native: bool) -> dict[str, int]:
    """Bytes per step by construction. ZeRO-3: ``full`` = every bucket of this rank, padded, fp32; forward
    gathers each once, backward again but the last (kept for it: ``Zero3Regather``) and the input
    embedding's (its gradient reads only the token ids, so backward never unpacks the table), the
    gradients are reduce-scattered whole, and the replicas all-reduce this rank's shard of them
    (``full / dp_shard``).
    ZeRO-1/2: the engine's flat gradient buckets reduce-scattered (``native``: by torch's reduce-scatter,
    else by gloo's stand-in, an all-reduce), the shard all-reduced across replicas, (ZeRO-1) gathered back
    whole, the updated fp32 shards gathered."""
    spec, zero = compiled.spec, compiled.plan.zero
    if zero == 3:
        buckets = [b for bs in compiled.zero3_buckets.values() for b in bs]
        full = sum(b.padded_numel * 4 for b in buckets)
        gathers = [n for s in compiled.pipeline.stages_of(spec.pp_rank) for n in s.gm.graph.nodes
                   if n.target == gather_params_op()]
        kept = gathers[-1].meta["val"].numel() * 4
        model = compiled.model
        table = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
        embedding = sum(b.padded_numel * 4 for b in buckets if table in b.names)
        stages = compiled.pipeline.stages_of(spec.pp_rank)
        graph = sum(comm.collective_bytes(s.gm)["gather_params"] for s in stages)
        assert graph == full, (graph, full)  # the graph's own counters see the same gathers
        return {"shard all_gather": 2 * full - kept - embedding, "shard reduce_scatter": full,
                "replicate all_reduce": full // spec.dp_shard}
    full = sum(b.padded_numel * 4 for b in compiled.engine.buckets)
    reduce = "reduce_scatter" if native else "all_reduce"
    return {f"shard {reduce}": full, "replicate all_reduce": full // spec.dp_shard,
            "shard all_gather": (2 if zero == 1 else 1) * full}


def hsdp_training(plan: str, native: bool, steps: int = 3) -> dict:
    """``steps`` clipped AdamW steps of ``plan`` next to one process; the last step's bytes per group.
    ``native``: the engine takes the path of backends with a reduce-scatter (NCCL's), which gloo also
    runs since torch 2.13, instead of gloo's all-reduce and slice."""
    old = data_parallel.backend_of
    if native:
        data_parallel.backend_of = lambda pg, device: "native"
    try:
        return _train(plan, native, steps)
    finally:
        data_parallel.backend_of = old


def _train(plan: str, native: bool, steps: int) -> dict:
    batch = _batch()
    compiled = fxpar.compile(zoo.build(NAME, seed=0), plan, example_kwargs=batch, optimizer=adamw, timeout=120,
                             max_grad_norm=MAX_NORM)
    reference = zoo.build(NAME, seed=0)
    ref_opt = adamw(reference.parameters())
    out = {"loss": 0.0, "weights": 0.0, "norm": 0.0, "ref_norms": []}
    for _ in range(steps):
        with CommTap() as tap:
            loss = compiled.step(**batch)
        ref_opt.zero_grad()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
        ref_opt.step()
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        out["norm"] = max(out["norm"], abs(compiled.last_grad_norm - ref_norm) / ref_norm)
        out["ref_norms"].append(ref_norm)
        state = compiled.full_state_dict()
        out["weights"] = max(out["weights"], max((state[k] - v).abs().max().item()
                                                 for k, v in reference.state_dict().items()))
    numel, size = trainable(compiled)  # this rank's stages' parameters, whole (TP-local)
    mine = numel * size
    return {**out, "measured": _by_group(tap, compiled.spec), "theory": _theory(compiled, native),
            "engine": dict(compiled.engine.comm), "counted": compiled.clipper.counted(), "mine": mine,
            "shard": compiled.spec.dp_shard, "mesh": str(compiled.mesh),
            "report": fxpar.inspect(compiled, quiet=True).data_parallel_table()}  # not the plan's price


@pytest.mark.parametrize("plan,native", [("dp=8,dp_replicate=2,zero=3", False),
                                         ("dp=4,dp_replicate=2,tp=2,zero=3", False),
                                         ("dp=4,dp_replicate=2,tp=2,zero=1", True),
                                         ("dp=4,dp_replicate=2,pp=2,zero=2", False)])
def test_hsdp_trains_as_one_process_and_moves_the_bytes_theory_says(pool8, plan, native):
    results = pool8.run(hsdp_training, plan, native, timeout=400)
    total = sum(p.numel() for p in zoo.build(NAME).parameters())
    assert sum(r["counted"] for r in results) == total  # every gradient entry counted once, not once per replica
    for r in results:
        assert r["loss"] <= TOL and r["weights"] <= TOL and r["norm"] <= TOL, r
        assert min(r["ref_norms"]) > 2 * MAX_NORM, r["ref_norms"]
        assert r["measured"] == r["theory"], (r["measured"], r["theory"])
        # the replicas exchange 1/dp_shard of this rank's parameters (buckets padded to the shard count)
        replicated = r["theory"]["replicate all_reduce"]
        assert r["mine"] // r["shard"] <= replicated <= r["mine"] // r["shard"] + 4 * 16, (replicated, r["mine"])
        assert r["engine"]["all_reduce"] == replicated, r["engine"]
        if "zero=3" not in plan:
            reduced = r["theory"]["shard reduce_scatter" if native else "shard all_reduce"]
            assert r["engine"]["reduce_scatter"] == reduced
            assert r["engine"]["all_gather"] == r["theory"]["shard all_gather"]
        assert "dp_replicate=2, dp_shard=" in r["mesh"] and "HSDP: 2 replicas" in r["report"], r["mesh"]


def _written(compiled) -> dict[str, tuple[tuple, list]]:
    """Every entry this rank writes to a checkpoint (model and optimizer), as (full shape, [(offsets, values)])."""
    held = local_state(compiled, optimizer=True)
    return {k: (h.shape, [(o, v.detach().clone()) for o, v in h.chunks]) for k, h in held.items()}


def _assemble(mine: dict) -> tuple[dict[str, torch.Tensor], int, int]:
    """The full tensors from every rank's written chunks, and how many entries no rank and how many several
    ranks write (both must be 0: DCP would drop a duplicate silently, so it is counted here)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full: dict[str, torch.Tensor] = {}
    times: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, (shape, chunks) in part.items():
            t = full.setdefault(k, torch.zeros(shape, dtype=chunks[0][1].dtype))
            n = times.setdefault(k, torch.zeros(shape, dtype=torch.int32))
            for o, v in chunks:
                box = tuple(slice(a, a + z) for a, z in zip(o, v.shape))
                t[box] = v
                n[box] += 1
    return full, sum(int((n == 0).sum()) for n in times.values()), sum(int((n > 1).sum()) for n in times.values())


def _holds(compiled, saved: dict[str, torch.Tensor]) -> bool:
    """Every optimizer state this rank holds (each replica's copy too) equals the saved full tensor's box."""
    for k, h in local_state(compiled, optimizer=True, writers_only=False).items():
        if k.startswith("optim."):
            for o, v in h.chunks:
                if not torch.equal(v, saved[k][tuple(slice(a, a + n) for a, n in zip(o, v.shape))]):
                    return False
    return True


def _load(directory: str, plan: str):
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(zoo.tiny_config(NAME)).train()
    compiled = fxpar.compile(meta, plan, example_kwargs=_batch(), optimizer=adamw, timeout=120,
                             weights=checkpoint.model_source(directory))
    checkpoint.load_optimizer(compiled, directory)
    return compiled


def hsdp_checkpoints(directory: str) -> dict:
    """Save under HSDP ZeRO-3; load under flat ZeRO-3 over 8 ranks and save that; load it under HSDP ZeRO-1
    with TP. Each load: the weights (every rank's own gather) and every optimizer state a rank holds equal
    the first save's bitwise, and the next steps' losses the uninterrupted run's."""
    batch = _batch()
    first = fxpar.compile(zoo.build(NAME, seed=0), "dp=4,dp_replicate=2,zero=3,tp=2", example_kwargs=batch,
                          optimizer=adamw, timeout=120)
    for _ in range(2):
        first.step(**batch)
    path = checkpoint.save(first, f"{directory}/hsdp", 2)
    weights = first.full_state_dict()
    states, missing, twice = _assemble(_written(first))
    go_on = [first.step(**batch).item() for _ in range(2)]
    out = {"states": sum(k.startswith("optim.") for k in states), "missing": missing, "twice": twice,
           "model": all(torch.equal(states[f"model.{k}"], v) for k, v in weights.items())}
    flat = _load(str(path), "dp=8,zero=3")
    back = checkpoint.save(flat, f"{directory}/flat", 2)  # the loaded state, saved again by a flat plan
    for name, compiled in (("flat", flat), ("hsdp", _load(str(back), "dp=4,dp_replicate=2,zero=1,tp=2"))):
        got = compiled.full_state_dict()
        out[name] = {"weights": all(torch.equal(got[k], weights[k]) for k in weights),
                     "states": _holds(compiled, states),
                     "losses": max(abs(compiled.step(**batch).item() - x) for x in go_on)}
    return out


def test_checkpoints_move_between_hsdp_and_flat_plans_bitwise(pool8, tmp_path):
    for r in pool8.run(hsdp_checkpoints, str(tmp_path), timeout=400):
        assert r["states"] > 0 and r["missing"] == r["twice"] == 0 and r["model"], r  # one writer per entry
        for name in ("flat", "hsdp"):
            assert r[name]["weights"] and r[name]["states"], (name, r)
            assert r[name]["losses"] <= TOL, (name, r)
