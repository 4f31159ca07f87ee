"""Pipeline parallelism end to end on gloo: every causal LM of the zoo, pp=2 and pp=4, four schedules.

Each case trains 3 AdamW steps with fxpar and with the single-process model on the same batch and
compares, at every step, the loss and the gradient of every parameter (each rank checks the
parameters its stages hold; together they must cover the model). One trace per model and pp is
compiled for all schedules (``compile(..., program=...)``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar import zoo
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc
from fxpar.testing.compare import grads_by_fqn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
SCHEDULES_PP4 = ("1f1b",)
TOL = 1e-5
STEPS = 3

pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _reference(name: str, batch: dict, steps: int):
    model = zoo.build(name, seed=0, stock=True)
    opt = _adamw(model.parameters())
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        out.append((loss.item(), grads_by_fqn(model)))
        opt.step()
    return out


def check_schedules(name: str, pp: int, schedules: tuple[str, ...], steps: int = STEPS) -> dict:
    """On every rank: compile for each schedule, train, compare with the reference; report the worst."""
    m = 4
    # the stock config (use_cache=True, as from_pretrained gives it) and the plain batch
    batch = zoo.example_inputs(name, zoo.tiny_config(name, stock=True), batch=2 * m, seq=8, stock=True)
    ref = _reference(name, batch, steps)
    model = zoo.build(name, seed=0, stock=True)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    mb = {k: (v[:2] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    program = fxpar.trace(model, example_kwargs=mb)
    report = {}
    for schedule in schedules:
        model.load_state_dict(initial)  # in place: the trace stays bound to the same parameters
        plan = fxpar.Plan(pp=pp, microbatches=m, schedule=schedule)
        try:
            compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=_adamw, timeout=60,
                                     program=program)
        except PlanError as e:
            if "cut points" in str(e):  # the model has too few places to cut for this many stages
                report[schedule] = ("too few cut points", str(e))
                continue
            raise
        worst_loss = worst_grad = 0.0
        checked: set[str] = set()
        for step in range(steps):
            loss = compiled.step(**batch)
            ref_loss, ref_grads = ref[step]
            worst_loss = max(worst_loss, abs(loss.item() - ref_loss))
            for stage in compiled.pipeline.stages_of(dist.get_rank()):
                for fqn, p in stage.gm.named_parameters():
                    assert p.grad is not None, f"{schedule} step {step}: {fqn} has no gradient"
                    worst_grad = max(worst_grad, (p.grad - ref_grads[fqn]).abs().max().item())
                    checked.add(fqn)
        report[schedule] = (worst_loss, worst_grad, sorted(checked), len(compiled.pipeline.stages))
    return report


def _assert_report(name, results, pp, schedules=SCHEDULES):
    all_params = {n for n, _ in zoo.build(name).named_parameters()}
    for schedule in schedules:
        per_rank = [r[schedule] for r in results]
        if per_rank[0][0] == "too few cut points":
            assert pp == 4, per_rank[0][1]
            continue
        loss = max(r[0] for r in per_rank)
        grad = max(r[1] for r in per_rank)
        covered = set().union(*(set(r[2]) for r in per_rank))
        print(f"{name} pp={pp} {schedule} stages={per_rank[0][3]}: |dloss| {loss:.1e} |dgrad| {grad:.1e}")
        assert loss <= TOL and grad <= TOL, (schedule, loss, grad)
        assert covered == all_params, f"{schedule}: parameters checked on no rank: {all_params - covered}"


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.CAUSAL_LM_NAMES)
def test_zoo_pp2_matches_single_process(name, pool2):
    _assert_report(name, pool2.run(check_schedules, name, 2, SCHEDULES, timeout=300), 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.CAUSAL_LM_NAMES)
def test_zoo_pp4_matches_single_process(name, pool4):
    """Four ranks, four stages, 1F1B. The other schedules run the same stage code in other orders (and the
    multi-stage ones two stages per rank): every zoo model checks them at pp=2 above, and interleaved
    1F1B also runs in the 8-rank dp x pp x tp plan with ZeRO-2 (tests/e2e/test_composition.py); all four
    schedules here cost 100 s of the suite, this one 30 s."""
    _assert_report(name, pool4.run(check_schedules, name, 4, SCHEDULES_PP4, timeout=400), 4, SCHEDULES_PP4)


def check_interleaved_zero_bubble(name: str) -> dict:
    return check_schedules(name, 2, ("interleaved_zb",))


def test_interleaved_zero_bubble(pool2):
    results = pool2.run(check_interleaved_zero_bubble, "llama", timeout=200)
    loss = max(r["interleaved_zb"][0] for r in results)
    grad = max(r["interleaved_zb"][1] for r in results)
    assert loss <= TOL and grad <= TOL


# ---- inference, state dict, explicit cuts -------------------------------------------------------------
def inference_and_state(name: str) -> dict:
    model = zoo.build(name, seed=0)
    batch = zoo.example_inputs(name, model, batch=4, seq=8)
    plan = fxpar.Plan(pp=2, microbatches=2, split_points={"model.layers.1": "beginning"}
                      if name != "gpt2" else {"transformer.h.1": "beginning"})
    compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=_adamw, timeout=60)
    compiled.step(**batch)
    ref = zoo.build(name, seed=0)
    opt = _adamw(ref.parameters())
    ref(**batch).loss.backward()
    opt.step()
    state = compiled.full_state_dict()
    ref_state = ref.state_dict()
    state_diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    infer = {k: v for k, v in batch.items() if k != "labels"}
    logits = compiled(**infer).logits
    logits_diff = (logits - ref(**infer).logits).abs().max().item()
    report = fxpar.inspect(compiled, quiet=True)
    return {"keys": sorted(state) == sorted(ref_state), "state": state_diff, "logits": logits_diff,
            "cuts": compiled.cuts, "stages": [s.first_module for s in compiled.pipeline.stages],
            "table": report.to_text(), "rows": report.to_dict()["stages"], "graph1": report.stage_graph(1),
            "tied": compiled.pipeline.tied}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_inference_full_state_dict_and_explicit_split(name, pool2):
    for r in pool2.run(inference_and_state, name, timeout=200):
        assert r["keys"], "full_state_dict keys differ from the model's state_dict"
        assert r["state"] <= TOL and r["logits"] <= TOL, r
        assert r["stages"][1] in ("model.layers.1", "transformer.h.1")
        # inspection: the stage table, predicted bubble, boundary tensors, any stage's graph
        assert "pipeline: pp=2, 2 stages, schedule 1f1b, 2 microbatches" in r["table"]
        assert "bubble" in r["table"] and "stage 0 sends" in r["table"]
        assert [row["stage"] for row in r["rows"]] == [0, 1] and r["rows"][1]["params"] > 0
        assert r["rows"][0]["send_bytes"] == r["rows"][1]["recv_bytes"] > 0
        assert ".1." in r["graph1"] and "= input ->" in r["graph1"]
        if name == "gpt2":  # tied embedding and head on different stages: shared, gradients summed
            assert r["tied"] == {"transformer.wte.weight": [0, 1]}
            assert "shares transformer.wte.weight" in r["table"]


# ---- bad input: clear errors before any communication, nothing hangs ----------------------------------
def compile_error(plan_kwargs: dict, batch_size: int = 4) -> str:
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=batch_size, seq=8)
    try:
        fxpar.compile(model, fxpar.Plan(**plan_kwargs), example_kwargs=batch, timeout=10)
    except PlanError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("plan_kwargs,batch,match", [
    (dict(pp=2, microbatches=3), 4, "does not divide into 3 microbatches"),
    (dict(pp=2, virtual_stages=20, schedule="interleaved_1f1b", microbatches=2), 4, "cut points"),
    (dict(pp=4), 4, "needs 4 ranks, but the world has 2"),
    (dict(pp=2, schedule="interleaved_1f1b", microbatches=5), 10, "microbatch"),
    (dict(pp=2, split_points={"model.layers.9": "beginning"}), 4, "owns no node"),
    (dict(pp=2, schedule="no-such-schedule"), 4, "schedule"),
])
def test_bad_plans_fail_on_every_rank_before_communicating(plan_kwargs, batch, match, pool2):
    errors = pool2.run(compile_error, plan_kwargs, batch, timeout=60)
    for e in errors:
        assert match in e, e


def dead_peer(timeout: float) -> str:
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=4, seq=8)
    compiled = fxpar.compile(model, fxpar.Plan(pp=2, microbatches=2), example_kwargs=batch, timeout=timeout)
    if dist.get_rank() == 0:
        return "left"  # rank 0 never runs the step: rank 1 waits for its activations
    try:
        compiled.step(**batch)
    except Exception as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_a_missing_peer_fails_with_a_clear_message(pool2):
    result = pool2.run(dead_peer, 3.0, timeout=120)
    assert "waiting for act of stage 0" in result[1] and "from pipeline rank 0" in result[1], result[1]
    pool2.restart()  # rank 0's unmatched send is still queued in gloo


# ---- balance and inspection on a meta-device Llama-3-8B ------------------------------------------------
@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_balance_on_llama3_8b_shape():
    import transformers

    from fxpar.cost import partition as P

    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    program = fxpar.trace(model, example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False})
    for pp in (4, 8):
        ours = P.balance(P.stage_costs(program, P.balanced_cuts(program, pp)))
        even = P.balance(P.stage_costs(program, P.even_layer_cuts(program, pp)))
        params = P.balance(P.stage_costs(program, P.param_count_cuts(program, pp)))
        print(f"pp={pp}: max/mean fxpar {ours:.3f}, even layers {even:.3f}, parameter count {params:.3f}")
        assert ours <= 1.10
        assert ours < even and ours < params


def uneven_labels() -> tuple[float, float, float]:
    """Microbatches with different numbers of ignored (-100) labels: the loss is still the batch mean."""
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=4, seq=8)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:2, :6] = -100  # the first microbatch counts far fewer tokens
    compiled = fxpar.compile(model, fxpar.Plan(pp=2, microbatches=2), example_kwargs=batch, timeout=60)
    loss = compiled.step(**batch)
    ref = zoo.build("llama", seed=0)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_grads = grads_by_fqn(ref)
    grad = max((p.grad - ref_grads[n]).abs().max().item()
               for s in compiled.pipeline.stages_of(dist.get_rank()) for n, p in s.gm.named_parameters())
    return loss.item(), ref_loss.item(), grad


def test_loss_weights_follow_counted_label_tokens(pool2):
    for loss, ref_loss, grad in pool2.run(uneven_labels, timeout=120):
        assert abs(loss - ref_loss) <= TOL and grad <= TOL, (loss, ref_loss, grad)


# ---- a Python int across a cut --------------------------------------------------------------------------
class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.score = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)

    def forward(self, x):
        n = (self.score(x) > 0).sum(1).max().item()  # a size only the data (and a parameter) knows
        return self.proj(x)[:, :n], n


class _Tail(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(6, 6)

    def forward(self, h, n):
        return self.out(h.reshape(h.shape[0] * n, 6)).pow(2).sum() / n  # n as a size and as a number


class IntAcrossCut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Head(), _Tail()])

    def forward(self, x):
        return {"loss": self.layers[1](*self.layers[0](x))}


def _int_model_and_batch():
    torch.manual_seed(0)
    model = IntAcrossCut()
    with torch.no_grad():
        model.layers[0].score.weight.fill_(1.0)
        model.layers[0].score.bias.zero_()
    x = torch.randn(4, 8, 6).abs()
    for row, positive in enumerate([3, 2, 5, 4]):  # microbatch 0 keeps 3 positions, microbatch 1 keeps 5
        x[row, positive:] *= -1
    return model, x


def int_across_cut() -> dict:
    model, x = _int_model_and_batch()
    ref = copy.deepcopy(model)
    ref_loss = sum(ref(x[i:i + 2])["loss"] for i in (0, 2)) / 2  # one process, the same two microbatches
    ref_loss.backward()
    plan = fxpar.Plan(pp=2, microbatches=2, split_points={"layers.1": "beginning"})
    compiled = fxpar.compile(model, plan, example_kwargs={"x": x}, optimizer=_adamw, timeout=60)
    loss = compiled.step(x=x)
    got = compiled.full_state_dict(grads=True)
    grads = {n: (got[n] - (p.grad if p.grad is not None else 0)).abs().max().item() for n, p in ref.named_parameters()}
    sends = [(type(o.meta["val"]).__name__, c) for s in compiled.pipeline.stages
             for o, c in zip(s.output_nodes(), s.consumers) if c]
    return {"loss": abs(loss.item() - ref_loss.item()), "grads": grads, "sends": sends}


def test_a_data_dependent_int_crosses_a_cut(pool2):
    """A size made by ``.item()`` on stage 0 (from a parameter: stage 1 cannot make it again) is sent to stage 1
    with the tensor it shapes; the two microbatches keep 3 and 5 positions, so an int baked at its traced value
    would give other numbers. Loss and every gradient equal one process running the same microbatches."""
    for r in pool2.run(int_across_cut, timeout=120):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, r
        assert ("SymInt", [1]) in r["sends"] and ("FakeTensor", [1]) in r["sends"], r["sends"]
