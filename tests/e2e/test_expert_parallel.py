"""Expert parallelism (``Plan(ep=N)``) on gloo ranks against one process: the zoo's mixtral and qwen2_moe
and two registry MoE models (olmoe, qwen3_moe, built tiny here) under ep=2 and dp=2 x ep=2, mixtral under
pp=2 x ep=2 and ep=2 with ZeRO-1: the loss, every gradient and the weights after an SGD step within 1e-5
of one process (with gradient clipping on one of them), each rank holding 1/ep of every expert parameter, the
all-to-all bytes of each rank equal to the rows it sends off-rank (counted here from the reference's own router
choices) x hidden x 4, and the load statistics equal to the reference's tokens per expert. Then the PlanErrors, on
one process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

import fxpar
from fxpar import checkpoint, zoo
from fxpar.api import price
from fxpar.ir.errors import PlanError
from fxpar.ir.mesh import MeshSpec
from fxpar.passes.expert_parallel import expert_regions
from fxpar.testing import multiproc
from fxpar.testing.reference import grads_by_fqn, train_against_reference

TOL = 1e-5
LR = 0.5
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)
pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=16,
             max_position_embeddings=64)
REGISTRY = {"olmoe": transformers.OlmoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig}


def build(name: str) -> torch.nn.Module:
    if name not in REGISTRY:
        return zoo.build(name, seed=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(REGISTRY[name](**SMALL)).train()


def inputs(name: str, model, batch: int) -> dict:
    if name not in REGISTRY:
        return zoo.example_inputs(name, model, batch=batch, seq=8)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def routing(reference, layers: list[str], batch: dict) -> dict[str, torch.Tensor]:
    """Each MoE layer's expert choices ``[tokens, k]`` in the reference's forward (the experts' own input)."""
    seen, hooks = {}, []
    for layer in layers:
        def hook(mod, args, kw, layer=layer):  # forward(hidden_states, top_k_index, top_k_weights)
            seen[layer] = (args + tuple(kw.values()))[1].detach()
        hooks.append(reference.get_submodule(layer).register_forward_pre_hook(hook, with_kwargs=True))
    loss = reference(**batch).loss
    for h in hooks:
        h.remove()
    return loss, seen


def ep_case(name: str, plan: str, batch_size: int, max_norm: float | None = None) -> dict:
    """One SGD step of ``plan`` next to one process (gradients clipped to ``max_norm``, as
    ``clip_grad_norm_``); what this rank measured and what it should have."""
    model = build(name)
    batch = inputs(name, model, batch_size)
    c = fxpar.compile(model, plan, example_kwargs=batch, optimizer=sgd, timeout=120, max_grad_norm=max_norm)
    loss = c.step(**batch)
    grads, weights = c.full_state_dict(grads=True), c.full_state_dict()
    reference = build(name)
    ref_loss, choices = routing(reference, c.ep.info.layers, batch)
    ref_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item() if max_norm else None
    ref_grads = grads_by_fqn(reference)
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    # expected bytes: rows this rank sends to other ep ranks (dispatch) and receives from them (combine)
    ep, me, dp_rank = c.spec.ep, c.spec.ep_rank, c.spec.dp_rank
    hidden = reference.config.hidden_size
    sent = recv = 0
    load = {}
    for layer in c.ep.stats:
        idx = choices[layer]
        owner = idx // (reference.get_submodule(layer).num_experts // ep)
        rows = idx.shape[0] // c.dp  # each replica's tokens, replica-major
        mine = owner[c.dp_rank * rows:(c.dp_rank + 1) * rows]
        sent += int((mine != me).sum())
        group = [owner[(dp_rank * ep + e) * rows:(dp_rank * ep + e + 1) * rows] for e in range(ep)]
        recv += sum(int((g == me).sum()) for e, g in enumerate(group) if e != me)
        mine_idx = idx[dp_rank * ep * rows:(dp_rank + 1) * ep * rows]
        load[layer] = torch.bincount(mine_idx.reshape(-1), minlength=int(idx.max()) + 1).tolist()
    expert_params = dict(model.named_parameters())
    return {
        "loss": abs(loss.item() - ref_loss.item()),
        "grads": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()),
        "weights": max((weights[k] - w).abs().max().item() for k, w in reference.state_dict().items()),
        "n_grads": len(ref_grads),
        "slices": {f: (c.program.tensor(f).shape[0], expert_params[f].shape[0]) for f in c.ep.info.experts},
        "comm": c.ep.comm, "expected": {"sent": sent * hidden * 4, "recv": recv * hidden * 4},
        "load": {k: v["tokens_per_expert"] for k, v in c.ep.stats.items()}, "ref_load": load,
        "layers": list(c.ep.info.layers), "ep": ep,
        "norm": None if norm is None else (abs(c.last_grad_norm - norm), norm),
    }


def check(results: list[dict]) -> None:
    ran = set()
    for r in results:
        assert r["loss"] <= TOL and r["grads"] <= TOL and r["weights"] <= TOL, r
        assert r["norm"] is None or r["norm"][0] <= TOL and r["norm"][1] > 0.1, r["norm"]  # and it clipped
        assert r["slices"] and all(local * r["ep"] == full for local, full in r["slices"].values()), r["slices"]
        assert r["comm"]["dispatch"] == r["comm"]["dispatch_bwd"] == r["expected"]["sent"] > 0, r
        assert r["comm"]["combine"] == r["comm"]["combine_bwd"] == r["expected"]["recv"] > 0, r
        for layer, counts in r["load"].items():
            assert counts[:len(r["ref_load"][layer])] == r["ref_load"][layer], (layer, counts, r["ref_load"][layer])
        ran |= set(r["load"])
    assert ran == set(results[0]["layers"]) and len(ran) >= 2  # every MoE layer ran somewhere


def two_rank_cases() -> list[dict]:
    return [ep_case(name, "ep=2", 4) for name in ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")] \
        + [ep_case("mixtral", "ep=2,zero=1", 4)]


def four_rank_cases() -> list[dict]:
    return [ep_case(name, "dp=2,ep=2", 8, 0.05 if name == "mixtral" else None)
            for name in ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")] \
        + [ep_case("mixtral", "pp=2,ep=2", 4)]


def test_ep2_matches_one_process(pool2):
    per_rank = pool2.run(two_rank_cases, timeout=300)
    for case in range(len(per_rank[0])):
        check([r[case] for r in per_rank])


def save_and_read(directory: str, plan: str) -> float:
    """``plan`` with AdamW, a step, ``checkpoint.save`` (each rank writes its experts and one replica the dense
    weights), then the saved model state read back whole: its worst difference from the gathered state."""
    batch = inputs("mixtral", build("mixtral"), 4)
    c = fxpar.compile(build("mixtral"), plan, example_kwargs=batch, timeout=120,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    c.step(**batch)
    path = checkpoint.save(c, directory, 1)
    saved, state = checkpoint.load_model_state(path), c.full_state_dict()
    assert saved.keys() == state.keys()
    return max((saved[k] - v).abs().max().item() for k, v in state.items())


def test_ep2_checkpoint_holds_every_expert(pool2, tmp_path):
    for plan in ("ep=2", "ep=2,zero=1"):  # whole expert slices; ZeRO-1 flat shards of each reduction group
        assert pool2.run(save_and_read, str(tmp_path / plan), plan, timeout=120) == [0.0, 0.0]


def test_dp2_ep2_and_pp2_ep2_match_one_process(pool4):
    per_rank = pool4.run(four_rank_cases, timeout=400)
    for case in range(len(per_rank[0])):
        check([r[case] for r in per_rank])


class LoopMoE(torch.nn.Module):
    """dbrx's and longcat_flash's eager experts, hand-built: a loop over the experts the batch hit (``nonzero``
    of the one-hot's presence), each expert's tokens found with ``where`` and added back with ``index_add_``;
    the up projection a flat ``[E * ffn, H]`` viewed per expert (dbrx), the down one stacked ``[E, H, ffn]``,
    a gate counting the zero-compute (identity) experts too (longcat_flash), which read no parameter. Top-1,
    the router leaning to expert 0, so that it gets more tokens from the two ranks than the trace's bound on
    one rank's (``u <= 10``); ``hop``: each ``where`` under ``no_grad`` (dbrx: inside a higher-order op)."""

    def __init__(self, hidden=8, ffn=6, experts=4, identity=2, top_k=1, hop=False):
        super().__init__()
        self.e, self.ffn, self.top_k, self.n, self.hop = experts, ffn, top_k, experts + identity, hop
        self.router = torch.nn.Linear(hidden, self.n, bias=False)
        self.register_buffer("lean", torch.tensor([2.0] + [0.0] * (self.n - 1)))
        self.up = torch.nn.Parameter(torch.randn(experts * ffn, hidden) * 0.3)
        self.gate = torch.nn.Parameter(torch.randn(self.n, ffn, hidden) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, ffn) * 0.3)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x, labels):
        tokens = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk((self.router(tokens) + self.lean).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(index, num_classes=self.n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            with torch.no_grad() if self.hop else contextlib.nullcontext():
                slot, tok = torch.where(mask[e])
            h = tokens[tok]
            if int(e) < self.e:
                up = self.up.view(-1, self.ffn, tokens.shape[-1])[e]
                h = torch.nn.functional.silu(h @ self.gate[e].T) * (h @ up.T) @ self.down[e].T
            out.index_add_(0, tok, h * weights[tok, slot, None])
        loss = (self.head(out + tokens).view(x.shape) - labels).square().mean()
        return transformers.modeling_outputs.CausalLMOutput(loss=loss)


def loop_case(hop: bool) -> dict:
    """ep=2 of :class:`LoopMoE` against one process, one SGD step; what each rank holds and ran."""
    from fxpar.ir.expert_ops import ep_nodes

    def model():
        torch.manual_seed(0)
        return LoopMoE(hop=hop)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 5, 8, generator=g), "labels": torch.randn(4, 5, 8, generator=g)}
    c = fxpar.compile(model(), "ep=2", example_kwargs=batch, optimizer=sgd, timeout=60)
    m = model()
    top = torch.topk((m.router(batch["x"].reshape(-1, 8)) + m.lean).softmax(-1), 1, dim=-1)[1]
    r = train_against_reference(c, m, sgd, batch, 1, grads=True)
    kinds = sorted({k for k, _ in ep_nodes(c.program.gm)})
    return {**r, "slices": {f: tuple(c.program.tensor(f).shape) for f in c.ep.info.experts}, "kinds": kinds,
            "comm": dict(c.ep.comm), "most": int(torch.bincount(top.reshape(-1)).max())}


@pytest.mark.parametrize("hop", [False, True])
def test_ep2_loop_over_experts_matches_one_process(pool2, hop):
    """The loop form (docs/expert_parallel.md): each rank runs its experts' blocks on every ep rank's gathered
    tokens and holds their rows of the stacked parameters; loss, every gradient, the weights within 1e-5."""
    for r in pool2.run(loop_case, hop, timeout=120):
        assert r["most"] > 10, r["most"]  # an expert got more tokens than one rank has: past the trace's bound
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r
        assert r["slices"] == {"up": (12, 8), "down": (2, 8, 6)}, r["slices"]  # the gate counts identities: whole
        assert r["kinds"] == ["ep_gather", "ep_scatter"], r["kinds"]
        # forward: x (10 x 8 floats), the weights (10 x 1) and the indices (10 x 1 int64) to the other rank,
        # and half of the [20, 8] sum; backward: the output's gradient, the weights' (x is an input: none)
        assert r["comm"] == {"gather": (80 + 10) * 4 + 10 * 8, "scatter": 80 * 4,
                             "gather_bwd": 80 * 4, "scatter_bwd": 10 * 4}, r["comm"]


def test_plan_errors_before_any_communication():
    """On one process (``fxpar.api.price`` builds without process groups): ep not dividing the experts, a
    model without experts, ep with tp or ZeRO-3; and the load statistics a priced ep plan shows (the
    example batch routed on one process) equal to the reference's tokens per expert."""
    model = zoo.build("mixtral", seed=0)
    batch = zoo.example_inputs("mixtral", model, batch=4, seq=8)
    llama = zoo.build("llama", seed=0)
    with pytest.raises(PlanError, match="has no expert layers"):
        price(llama, "ep=2", example_kwargs=zoo.example_inputs("llama", llama, batch=2, seq=8),
                    optimizer=sgd)
    priced = price(model, "ep=2", example_kwargs=batch, optimizer=sgd)  # load statistics before launching
    _, choices = routing(zoo.build("mixtral", seed=0), priced.ep.info.layers, batch)
    for layer, idx in choices.items():
        assert priced.ep.stats[layer]["tokens_per_expert"] == torch.bincount(idx.reshape(-1), minlength=4).tolist()
    with pytest.raises(PlanError, match="has 4 experts, which do not split over 3 ranks"):
        expert_regions(priced.result.traced, 3)  # the check compile runs on its first trace, before any group
    with pytest.raises(PlanError, match="tensor parallelism"):
        fxpar.Plan(ep=2, tp=2)
    with pytest.raises(PlanError, match="zero=3"):
        fxpar.Plan.parse("ep=2,zero=3")


def test_mesh_places_ep_between_dp_and_pp():
    """rank = ((dp_rank * ep + ep_rank) * pp + pp_rank) * tp + tp_rank; dense gradients reduce over the
    dp x ep replicas of one pipeline position, experts over dp, tokens travel within ep."""
    m = MeshSpec(dp=2, ep=2, pp=2, rank=6)
    assert m.coords() == {"dp": 1, "pp": 0, "tp": 0, "ep": 1} and m.world_size == 8
    assert m.group_name("ep") == "ep:4,6" and m.group_name("dp") == "dp:2,6" and m.group_name("pp") == "pp:6,7"
    assert m.replica_group_name() == "dpep:0,2,4,6" and m.replica_rank == 3 and m.replicas == 4
    assert m.shape == (2, 2, 2, 1) and MeshSpec(dp=2, pp=2).shape == (2, 2, 1)
