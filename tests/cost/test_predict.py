"""Predicted activation memory (against what autograd really saves), its ordering under recompute
policies and schedules, and the communication formulas of one training step."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import fxpar
from fxpar import zoo
from fxpar.cost import comm
from fxpar.cost.predict import activation_memory, peak_activations, stage_activations
from fxpar.ir.schedule import build_schedule

TOLERANCE = 0.02  # of the measured bytes (exact on these two today; the table is by op family, not per kernel)


def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs its forward, parameters and
    buffers left out (``run`` returns them: they are held whether or not anything is saved)."""
    seen: dict = {}

    def pack(t):
        seen[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        weights = run()
    skip = {StorageWeakRef(t.untyped_storage()) for t in weights}
    return sum(b for k, b in seen.items() if k not in skip)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def traced(request):
    torch.manual_seed(0)
    model = zoo.build(request.param, num_hidden_layers=3)
    kwargs = zoo.example_inputs(request.param, model, batch=2, seq=16)
    return model, kwargs, fxpar.trace(model, example_kwargs=kwargs)


def test_none_prediction_matches_what_autograd_saves(traced):
    model, kwargs, program = traced

    def run():
        program(**kwargs)
        return [*model.parameters(), *model.buffers()]

    measured = saved_bytes(run)
    predicted = activation_memory(program)["none"]["peak"]
    print(f"{type(model).__name__}: predicted {predicted} B, measured {measured} B")
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


def test_recompute_policies_order_none_selective_layer(traced):
    _, _, program = traced
    acts = stage_activations(program)
    (none, none_t), (sel, sel_t), (layer, layer_t) = acts["none"], acts["selective"], acts["layer"]
    assert none > sel > layer > 0
    assert none_t == 0 and 0 < sel_t < layer_t  # what is not kept is recomputed, one layer at a time
    peaks = {k: v["peak"] for k, v in activation_memory(program).items()}
    assert peaks["none"] > peaks["selective"] > peaks["layer"]


def test_activations_follow_the_microbatches_in_flight():
    per_stage = {0: (100, 30), 1: (50, 10)}
    for schedule, in_flight in (("gpipe", 4), ("1f1b", 2)):  # rank 0 of pp=2, 4 microbatches
        actions = build_schedule(schedule, 2, 4)[0]
        assert peak_activations(per_stage, actions) == in_flight * 100 + 30, schedule
    assert peak_activations(per_stage, build_schedule("1f1b", 2, 4)[1]) == 50 + 10  # the last stage: one


def test_data_parallel_formulas():
    numel, dp = 1000, 4
    rows = {z: {(r["collective"], r["what"]): (r["payload"], r["sent"])
                for r in comm.data_parallel_collectives(numel, 4, dp, z)} for z in range(4)}
    assert rows[0] == {("all_reduce", "gradients"): (4000, 2 * 3 * 4000 // 4)}
    assert rows[1] == {("all_reduce", "gradients"): (4000, 6000), ("all_gather", "parameters"): (4000, 3000)}
    assert rows[2] == {("reduce_scatter", "gradients"): (4000, 3000), ("all_gather", "parameters"): (4000, 3000)}
    assert rows[3] == {}  # ZeRO-3's collectives are graph nodes
    assert comm.data_parallel_collectives(numel, 4, 1, 1) == []
