"""``fxpar.compile(model, "auto")`` on 2, 4 and 8 gloo ranks: every rank chooses the plan on its own (world
from the process group, batch and length from the example batch, this host's profile), the ranks agree on
it, and training under it gives the losses and weights of one process running the unmodified model. On 2
ranks the host's profile as it is; on 4 and 8 with less memory per rank than the unconstrained choice
needs, so the planner picks tensor / pipeline parallel plans and those are checked too.

Each world runs in its own pool, closed after its test, so at most 8 ranks live at once on this 2-core box.
The chosen plan is printed (``pytest -s``) and named in every failure.
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc

NAME, BATCH, SEQ, STEPS, TOL = "llama", 8, 8, 3, 1e-5
pool2 = multiproc.rank_pool_fixture(2, scope="function")
pool4 = multiproc.rank_pool_fixture(4, scope="function")
pool8 = multiproc.rank_pool_fixture(8, scope="function")


def sgd(params):
    """Plain SGD: a wrong gradient shows in the next step's loss (Adam would hide its scale)."""
    return torch.optim.SGD(params, lr=0.5)


def auto_run(memory: int | None = None) -> dict:
    """STEPS training steps under the plan compile chose; the losses and the full state after them.
    ``memory``: bytes per rank in this host's profile (given to compile as a calibrated profile would be,
    through FXPAR_PROFILE), to make the planner shard the model."""
    import dataclasses
    import os
    import tempfile

    from fxpar.cost.profiles import profile_for_device

    saved = os.environ.get("FXPAR_PROFILE")
    if memory is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="fxpar-e2e-auto-"), "profile.json")
        dataclasses.replace(profile_for_device("cpu"), memory=memory).save(path)
        os.environ["FXPAR_PROFILE"] = path
    try:
        batch = zoo.example_inputs(NAME, zoo.tiny_config(NAME), batch=BATCH, seq=SEQ)
        compiled = fxpar.compile(zoo.build(NAME, seed=0), "auto", example_kwargs=batch, optimizer=sgd, timeout=120)
    finally:
        os.environ.pop("FXPAR_PROFILE", None)
        if saved is not None:
            os.environ["FXPAR_PROFILE"] = saved
    losses = [compiled.step(**batch).item() for _ in range(STEPS)]
    state = {k: v.clone() for k, v in compiled.full_state_dict().items()}
    return {"plan": compiled.plan.to_text(), "losses": losses, "state": state,
            "best": compiled.autoplan.best == compiled.plan, "ranked": len(compiled.autoplan.ranked),
            "memory": compiled.autoplan.estimate.memory["total"]}


def tight_memory(world: int, fraction: float) -> tuple[int, str]:
    """A memory per rank ``fraction`` of what the unconstrained choice needs on this host's profile, and that
    choice: below it the planner has to shard further (TP, PP, recompute)."""
    from fxpar.cost.profiles import profile_for_device

    free = fxpar.autoplan(zoo.build(NAME, seed=0), world, device=profile_for_device("cpu"), global_batch=BATCH,
                          seq=SEQ)
    return int(fraction * free.estimate.memory["total"]), free.best.to_text()


def reference() -> tuple[list[float], dict]:
    batch = zoo.example_inputs(NAME, zoo.tiny_config(NAME), batch=BATCH, seq=SEQ)
    model = zoo.build(NAME, seed=0)
    opt = sgd(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def check(results: list[dict], world: int, memory: int | None = None) -> None:
    ref_losses, ref_state = reference()
    plan = results[0]["plan"]
    limit = f" with {memory} bytes per rank" if memory else ""
    print(f"compile(model, 'auto') on {world} ranks{limit} chose {plan} ({results[0]['ranked']} feasible plans)")
    assert {r["plan"] for r in results} == {plan}, [r["plan"] for r in results]
    for rank, r in enumerate(results):
        assert r["best"] and r["ranked"] >= 1, (plan, r)
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
        assert max(diffs) <= TOL, (plan, rank, r["losses"], ref_losses)
        worst = max((r["state"][k] - v).abs().max().item() for k, v in ref_state.items())
        assert worst <= TOL, (plan, rank, worst)


@pytest.mark.slow
def test_compile_auto_on_2_ranks_matches_one_process(pool2):
    check(pool2.run(auto_run, timeout=300), 2)


@pytest.mark.slow
@pytest.mark.parametrize("world,share", [(4, 0.6), (8, 0.55)])
def test_compile_auto_with_tight_memory_matches_one_process(world, share, request):
    """Memory for 60% (55%) of what the unconstrained (data-parallel) choice needs: the planner shards further."""
    memory, free = tight_memory(world, share)
    results = request.getfixturevalue(f"pool{world}").run(auto_run, memory, timeout=300)
    check(results, world, memory)
    assert results[0]["plan"] != free and results[0]["memory"] <= memory, (free, results[0]["plan"])
