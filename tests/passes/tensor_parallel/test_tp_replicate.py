"""``Plan.tp_replicate``: module globs kept whole on every TP rank over whichever plan applies, the
command-line form (``--plan tp=4,tp_replicate=model.embed_tokens``) the TP errors name as their fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar import PlanError, zoo
from fxpar.api import price
from fxpar.testing import multiproc
from fxpar.train.models import example_kwargs

pool2 = multiproc.rank_pool_fixture(2)


def _price(model, text: str):
    return price(model, fxpar.Plan.parse(text), example_kwargs=example_kwargs(model, 4, 8),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_a_vocabulary_tp_does_not_divide_is_cut_unevenly():
    """vocabulary 301 at tp=2: the embedding and the LM head are cut into torch.chunk's shares (151, 150)."""
    tp = _price(zoo.build("llama", vocab_size=301), "tp=2").result.tp
    for fqn in ("model.embed_tokens.weight", "lm_head.weight"):
        layout = tp.layout(fqn)
        assert [layout.local_shape((301, 64), r) for r in (0, 1)] == [(151, 64), (150, 64)]
        assert [layout.slice(torch.zeros(301, 64), r).shape[0] for r in (0, 1)] == [151, 150]


def test_the_error_names_the_command_line_form_and_it_works():
    model = zoo.build("llama", vocab_size=3)  # 3 rows cannot give 4 ranks a part each
    with pytest.raises(PlanError, match=r"keep it whole with --plan tp=4,tp_replicate=model\.embed_tokens "
                                        r"\(in a plan file: tp_replicate = \[\"model\.embed_tokens\"\]\)"):
        _price(model, "tp=4")
    with pytest.raises(PlanError, match=r"--plan tp=4,tp_replicate=lm_head"):  # the next one, once that is whole
        _price(model, "tp=4,tp_replicate=model.embed_tokens")
    sharded = set(_price(model, "tp=4,tp_replicate=model.embed_tokens+lm_head").result.tp.sharded)
    assert "model.embed_tokens.weight" not in sharded and "lm_head.weight" not in sharded
    assert "model.layers.0.mlp.up_proj.weight" in sharded  # the model's plan goes on around them


def test_globs_cover_submodules_and_a_typo_names_modules_near_it():
    sharded = set(_price(zoo.build("llama"), "tp=2,tp_replicate=model.layers.*.mlp").result.tp.sharded)
    assert not any(".mlp." in f for f in sharded)
    assert "model.layers.1.self_attn.q_proj.weight" in sharded
    with pytest.raises(PlanError, match=r"Plan.tp_replicate entry 'model.layer' matches no module; modules "
                                        r"include \[.*'model.layers'"):
        _price(zoo.build("llama"), "tp=2,tp_replicate=model.layer")


def _train_replicated(steps: int = 2) -> dict:
    model = zoo.build("llama", seed=0, vocab_size=301)
    batch = example_kwargs(model, 4, 8)
    plan = fxpar.Plan.parse("tp=2,tp_replicate=model.embed_tokens+model.layers.*.mlp")
    compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                             timeout=60)
    ref = zoo.build("llama", seed=0, vocab_size=301)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = {"loss": 0.0, "grad": 0.0}
    for _ in range(steps):
        loss = compiled.step(**batch).item()
        opt.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        grads = compiled.full_state_dict(grads=True)
        out["grad"] = max(out["grad"], max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()))
        out["loss"] = max(out["loss"], abs(loss - ref_loss.item()))
        opt.step()
    out["sharded"] = sorted(compiled.tp_info.sharded)
    dist.barrier()
    return out


@pytest.mark.slow
def test_replicated_modules_train_as_one_process(pool2):
    for r in pool2.run(_train_replicated, timeout=200):
        sharded = r.pop("sharded")
        assert max(r.values()) <= 1e-5, r
        assert "model.embed_tokens.weight" not in sharded and not any(".mlp." in f for f in sharded)
        assert "lm_head.weight" in sharded and "model.layers.0.self_attn.o_proj.weight" in sharded
