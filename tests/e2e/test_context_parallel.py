"""Context parallelism (``Plan(cp=N)``) on gloo ranks against one process: the loss, the gradient norm and
every parameter after an SGD step of learning rate 1 (so every gradient entry) equal the single-process run's,
on a grouped-query Llama with a packed batch of several documents per row (position ids restarting) and
ignored labels, alone and with dp, ZeRO, HSDP, tp and pp, on a Gemma-2 (sliding-window layers, soft-capped
eager attention), a Mistral (a sliding window on every layer), a Mixtral and a Qwen2-MoE (router and experts on
each rank's tokens) and a Mixtral with expert parallelism; evaluation
gives the unsplit loss, generation is refused; each layer's key/value bytes equal the theory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar import zoo
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc

TOL = 1e-5
pool2 = multiproc.rank_pool(2, shared=True)
pool4 = multiproc.rank_pool(4)
pool8 = multiproc.rank_pool(8)
pytestmark = pytest.mark.slow


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def _batch(name: str, batch: int, seq: int, packed: bool) -> dict:
    kw = zoo.example_inputs(name, zoo.tiny_config(name), batch=batch, seq=seq)
    kw["labels"][0, :3] = -100  # ignored targets: the mean divides by the count over the whole sequence
    if packed:  # three documents in row 0, two in the others: positions restart at each
        starts = [[0, seq // 4, 5 * seq // 8]] + [[0, seq // 2]] * (batch - 1)
        kw["position_ids"] = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row, row[1:] + [seq])])
                                          for row in starts])
    return kw


class KvTap(TorchDispatchMode):
    """Bytes of the fxpar gathers (forward) and reduce-scatters (their backward) on groups named ``cp:``, and
    the bytes Ulysses' all-to-alls (forward and backward) send off-rank: ``(n - 1) / n`` of each input."""

    def __init__(self):
        super().__init__()
        self.bytes = {"all_gather_rs_bwd": 0, "reduce_scatter": 0, "all_to_all": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if func.namespace == "fxpar" and name in self.bytes and str(args[1]).startswith("cp:"):
            t = out if name == "all_gather_rs_bwd" else args[0]
            size = t.numel() * t.element_size()
            if name == "all_to_all":  # the block a rank keeps never leaves it
                n = len(str(args[1]).split(":")[1].split(","))
                size = size * (n - 1) // n
            self.bytes[name] += size
        return out


def kv_theory(name: str, batch: int, seq: int) -> int:
    """Every layer's keys and values, whole sequence, KV heads only, fp32."""
    cfg = zoo.tiny_config(name)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * seq * head * 4


def ulysses_theory(name: str, batch: int, seq: int, cp: int, tp: int, overrides: dict) -> int:
    """Bytes a rank sends by Ulysses' all-to-alls in one forward: per layer its queries, keys, values (KV heads)
    and output, this rank's ``seq / cp`` rows of its TP rank's heads, ``(cp - 1) / cp`` of each, fp32."""
    cfg = zoo.tiny_config(name, **overrides)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) // tp
    return cfg.num_hidden_layers * heads * batch * (seq // cp) * head * 4 * (cp - 1) // cp


def cp_training(name: str, plan: str, batch: int, seq: int, packed: bool, extras: bool,
                overrides: dict | None = None) -> dict:
    """One SGD step of ``plan`` next to one process; ``extras``: evaluation, inference without labels and
    generation too (their programs cost a compile each, so a few cases check them); ``overrides``: config
    fields of the zoo model."""
    kw = _batch(name, batch, seq, packed)
    overrides = overrides or {}
    compiled = fxpar.compile(zoo.build(name, seed=0, **overrides), plan, example_kwargs=kw, optimizer=sgd,
                             timeout=120, max_grad_norm=float("inf"))  # measured, not clipped
    reference = zoo.build(name, seed=0, **overrides)
    opt = sgd(reference.parameters())
    with KvTap() as tap:
        loss = compiled.step(**kw)
    ref = reference(**kw).loss
    ref.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    opt.step()
    state, want = compiled.full_state_dict(), reference.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in want.items())
    moved = max((v - zoo.build(name, seed=0, **overrides).state_dict()[k]).abs().max().item() for k, v in want.items())
    evaluated, logits, refused = 0.0, 0.0, "splits each sequence"
    if extras:
        with torch.no_grad():  # evaluation under cp: the unsplit loss; without labels, the whole logits
            evaluated = abs(compiled(**kw).loss.item() - reference(**kw).loss.item())
            ids = {k: v for k, v in kw.items() if k != "labels"}
            logits = (compiled(**ids).logits - reference(**ids).logits).abs().max().item()
        try:
            compiled.generate(kw["input_ids"][:, :4], 2)
            refused = ""
        except PlanError as e:
            refused = str(e)
    shown = fxpar.inspect(compiled, quiet=True)  # the report's gathers: per microbatch, this rank's stages
    rows, text = shown.to_dict()["context_parallel"], shown.to_text()
    reported = sum(row["bytes"] for row in rows if row["kind"] == "all-gather") * compiled.m
    sent = sum(row["sent"] for row in rows if row["kind"] == "all-to-all") * compiled.m
    assert f"cp={compiled.plan.cp}, this rank is cp rank" in text
    p = compiled.plan
    return {"loss": abs(loss.item() - ref.item()), "weights": diff, "moved": moved, "reported": reported,
            "norm": abs(compiled.last_grad_norm - norm) / norm, "eval": evaluated, "logits": logits,
            "kv": tap.bytes, "kv_theory": kv_theory(name, batch // p.dp, seq), "refused": refused,
            "reported_a2a": sent, "a2a_theory": ulysses_theory(name, batch // p.dp, seq, p.cp, p.tp, overrides),
            "kept": "kept the all-gather" in text, "gathered": list(compiled.build.shared["cp"].gathered),
            "routed": {k: sum(v["tokens_per_expert"]) for k, v in (compiled.ep.stats or {}).items()},
            "groups": (compiled.spec.shard_ranks(), compiled.spec.replicate_ranks()),
            "replicated": compiled.engine.comm["all_reduce"] if compiled.engine is not None else 0}


@pytest.mark.parametrize("name,plan,packed,extras", [
    ("llama", "cp=2", True, True),
    ("llama", "dp=2,cp=2", False, False),
    ("llama", "dp=2,cp=2,zero=3", True, False),
    ("llama", "cp=4", False, False),
    ("llama", "cp=2,tp=2", True, True),
    ("llama", "cp=2,pp=2", False, True),
    ("llama", "dp=2,cp=2,tp=2", True, False),
    ("gemma2", "cp=2", True, False),  # sliding-window layers, soft-capped eager attention, tied embeddings
    ("mistral", "dp=2,cp=2,zero=1", True, False),  # sliding window over every layer
    ("llama", "cp=2,recompute=layer", True, False),  # each layer's gathers run again in its recomputed forward
])
def test_context_parallel_trains_as_one_process(pool2, pool4, pool8, name, plan, packed, extras):
    world = fxpar.Plan.parse(plan).world_size
    pool = {2: pool2, 4: pool4, 8: pool8}[world]
    results = pool.run(cp_training, name, plan, 4, 16, packed, extras, timeout=300)
    for r in results:
        assert r["loss"] <= TOL and r["weights"] <= TOL and r["norm"] <= TOL, r
        assert r["moved"] > 1e-3, r  # the step really changed the weights
        assert r["eval"] <= TOL and r["logits"] <= TOL, r
        assert "splits each sequence" in r["refused"], r["refused"]
        again = 2 if "recompute=layer" in plan else 1
        assert r["reported"] * again == r["kv"]["all_gather_rs_bwd"], r  # fxpar inspect shows every gather
    # every layer's whole keys and values (KV heads only) gathered once per cp rank, reduce-scattered once back;
    # a TP rank gathers its heads, a pipeline rank its stage's layers: over all ranks, dp x cp times each
    p = fxpar.Plan.parse(plan)
    for kind in ("all_gather_rs_bwd", "reduce_scatter"):
        again = 2 if kind == "all_gather_rs_bwd" and p.recompute == "layer" else 1
        assert sum(r["kv"][kind] for r in results) == results[0]["kv_theory"] * p.dp * p.cp * again, (kind, results)


@pytest.mark.parametrize("name,plan", [
    ("llama", "dp=4,dp_replicate=2,cp=2,zero=3"),  # HSDP: 2 replicas of dp=2
    ("mixtral", "ep=2,cp=2,zero=1"),  # tokens to their experts' ep rank; expert slices reduced over dp x cp
])
def test_context_parallel_with_hsdp_or_ep_trains_as_one_process(pool4, pool8, name, plan):
    """HSDP with cp: ZeRO shards over a replica's dp / dp_replicate x cp ranks, each shard all-reduced across its
    dp_replicate copies (same cp rank). ep with cp: each cp rank's tokens go to their experts' ep rank, expert
    gradients reduce over the dp x cp ranks of an ep rank. Both equal to one process."""
    pool = {4: pool4, 8: pool8}[fxpar.Plan.parse(plan).world_size]
    results = pool.run(cp_training, name, plan, 4, 16, True, False, timeout=300)
    for r in results:
        assert r["loss"] <= TOL and r["weights"] <= TOL and r["norm"] <= TOL, r
        assert r["moved"] > 1e-3, r
    if "dp_replicate" not in plan:
        # the router and the experts run on this cp rank's tokens (nothing gathered by the fallback): an ep
        # group (one cp rank, its ep ranks' 2 sequences each) dispatches 4 x 16 / cp tokens x top-2, not 4 x 16
        for r in results:
            assert r["gathered"] == [] and len(r["routed"]) == 2, r
            assert all(n == 4 * 16 // 2 * 2 for n in r["routed"].values()), r["routed"]
        return
    full = 4 * sum(p.numel() for p in zoo.build(name).parameters())
    for r in results:  # the replicas exchange one shard of four
        assert full // 4 <= r["replicated"] <= full // 4 + 4 * 16, r
    # ranks are (dp rank x 2 + cp rank): dp ranks 0, 1 (both cp ranks) shard together, dp rank d copies d + 2
    assert {tuple(r["groups"][0]) for r in results} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert {tuple(r["groups"][1]) for r in results} == {(0, 4), (1, 5), (2, 6), (3, 7)}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_under_cp_runs_on_this_ranks_tokens(pool2, name):
    """The zoo's Mixtral and Qwen2-MoE (top-2 of 4 experts; Qwen2-MoE with a gated shared expert) at cp=2 on a
    packed batch: the router and the experts run on each rank's tokens, nothing gathered by the fallback, and
    the loss, the gradient norm and every parameter after a step equal one process."""
    for r in pool2.run(cp_training, name, "cp=2", 4, 16, True, False, timeout=300):
        assert r["loss"] <= TOL and r["weights"] <= TOL and r["norm"] <= TOL, r
        assert r["moved"] > 1e-3 and r["gathered"] == [], r


@pytest.mark.parametrize("name,plan,overrides", [
    ("llama", "cp=2,cp_attention=ulysses", {}),  # grouped-query: 4 query heads, 2 KV heads
    ("gemma2", "cp=2,cp_attention=ulysses", {}),  # sliding-window layers, soft-capped eager attention
    ("llama", "cp=2,tp=2,cp_attention=ulysses", {"num_key_value_heads": 4}),  # per TP rank 2 heads: 1 per cp rank
])
def test_ulysses_trains_as_one_process(pool2, pool4, name, plan, overrides):
    """Ulysses (queries, keys, values and output by all-to-all, each rank attending with its heads over the
    whole, packed sequence; SDPA, and Gemma-2's eager attention) equals one process; each rank sends, per
    layer and direction, (cp - 1) / cp of its queries, keys (KV heads), values and output, and ``fxpar
    inspect`` shows every all-to-all."""
    pool = {2: pool2, 4: pool4}[fxpar.Plan.parse(plan).world_size]
    for r in pool.run(cp_training, name, plan, 4, 16, True, False, overrides, timeout=300):
        assert r["loss"] <= TOL and r["weights"] <= TOL and r["norm"] <= TOL, r
        assert r["moved"] > 1e-3, r
        assert r["kv"]["all_gather_rs_bwd"] == 0 and not r["kept"], r  # no attention kept the all-gather
        assert r["kv"]["all_to_all"] == 2 * r["a2a_theory"], r  # forward and backward
        assert r["reported_a2a"] == r["a2a_theory"], r
