"""The pipeline check ``fxpar.compile`` and ``fxpar plan`` share (:mod:`fxpar.planner.stage_check`): stages
nearly empty or a bubble over the limit warn once, on rank 0, with the numbers and a better plan."""

from __future__ import annotations

import logging

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.cost.partition import balanced_cuts
from fxpar.cost.profiles import PROFILES
from fxpar.planner import feasibility
from fxpar.planner.stage_check import BUBBLE_LIMIT, decoder_layers, pipeline_warning, stage_loads
from fxpar.report.budget import graph_flops
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool_fixture(2)


@pytest.fixture(scope="module")
def program():
    model = zoo.build("llama", seed=0, num_hidden_layers=4)
    return fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model, batch=1, seq=8))


def _warning(program, text: str, batch: int = 16):
    plan = fxpar.Plan.parse(text)
    setup = feasibility.pipeline_setup(plan, batch)
    return pipeline_warning(program, balanced_cuts(program, setup.n_stages, PROFILES["cpu"]), plan, setup,
                            PROFILES["cpu"])


def test_loads_add_up_to_the_program(program):
    """Every node, parameter and decoder layer lands in exactly one stage."""
    loads = stage_loads(program, balanced_cuts(program, 4, PROFILES["cpu"]), PROFILES["cpu"])
    assert sum(x.params for x in loads) == sum(p.numel for p in program.params.values() if not p.is_buffer)
    assert sum(x.flops for x in loads) == sum(graph_flops(program.gm))  # higher-order ops' bodies included
    assert decoder_layers(program) == [f"model.layers.{i}" for i in range(4)]
    assert sum(x.layers for x in loads) + sum(x.partial for x in loads) >= 4


def test_sound_pipelines_say_nothing(program):
    for text in ("pp=2", "pp=4", "pp=2,microbatches=8", "dp=2,pp=2"):
        assert _warning(program, text) is None, text


def test_nearly_empty_stages_suggest_the_largest_pp_with_a_layer_each(program):
    text = _warning(program, "dp=2,pp=8,tp=2", batch=16)
    assert "on LlamaForCausalLM with 4 decoder layers:" in text and "stages are nearly empty" in text
    assert "e.g. --plan dp=4,pp=4,tp=2 on the same 32 ranks" in text  # dp takes the ranks pp gives up


def test_a_bubble_over_the_limit_suggests_microbatches(program):
    text = _warning(program, "pp=4,microbatches=2,schedule=gpipe", batch=6)
    bubble = float(text.split("idles ")[1].split("%")[0]) / 100
    assert bubble > BUBBLE_LIMIT
    assert "with a global batch that is a multiple of 12 (now 6)" in text  # 12 microbatches: 6 do not divide


def _compile_interleaved() -> list[str]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("fxpar")
    keep = Keep()
    logger.addHandler(keep)
    try:
        model = zoo.build("llama", seed=0)  # 2 decoder layers over 4 stages: one holds a norm
        batch = zoo.example_inputs("llama", model, batch=4, seq=8)
        fxpar.compile(model, fxpar.Plan(pp=2, schedule="interleaved_1f1b", microbatches=4), example_kwargs=batch,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout=60)
    finally:
        logger.removeHandler(keep)
    return [m for m in seen if "pipeline pp=2" in m]


@pytest.mark.slow
def test_compile_warns_once_on_rank_0(pool2):
    first, second = pool2.run(_compile_interleaved, timeout=200)
    assert len(first) == 1 and second == []
    assert "pipeline pp=2 (4 stages, interleaved_1f1b, 4 microbatches) on LlamaForCausalLM with 2 decoder layers: " \
           "1 of 4 stages are nearly empty" in first[0]
