"""The program cache (``FXPAR_PROGRAM_CACHE``): a second trace of an unchanged model loads the program the
first one saved instead of calling torch.export, and gives the same graph, loss and gradients; a changed
config value traces again."""

from __future__ import annotations

import torch

import fxpar
from fxpar import zoo
from fxpar.testing.compare import grads_by_fqn


def _counting_exports(monkeypatch) -> list:
    calls = []
    real = torch.export.export

    def export(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    return calls


def _loss_and_grads(program, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = program(**inputs).loss
    loss.backward()
    return loss.detach(), grads_by_fqn(model)


def test_a_second_trace_loads_the_saved_program_and_a_changed_config_traces_again(monkeypatch, tmp_path):
    monkeypatch.setenv("FXPAR_PROGRAM_CACHE", str(tmp_path))
    exports = _counting_exports(monkeypatch)
    model = zoo.build("llama", seed=0, num_hidden_layers=1)
    inputs = zoo.example_inputs("llama", model, batch=2, seq=8)

    fresh = fxpar.trace(model, example_kwargs=inputs, frontend="export")
    assert len(exports) == 1 and len(list(tmp_path.glob("*.pt2"))) == 1
    cached = fxpar.trace(model, example_kwargs=inputs, frontend="export")
    assert len(exports) == 1, "the second trace called torch.export instead of loading the saved program"
    assert str(cached.gm.graph) == str(fresh.gm.graph)
    assert cached.gm.code == fresh.gm.code

    loss, grads = _loss_and_grads(fresh, model, inputs)
    loss_c, grads_c = _loss_and_grads(cached, model, inputs)
    assert torch.equal(loss_c, loss)
    assert grads_c.keys() == grads.keys() and all(torch.equal(grads_c[k], grads[k]) for k in grads)

    other = zoo.build("llama", seed=0, num_hidden_layers=1, rms_norm_eps=1e-3)  # same tensors, one config value changed
    fxpar.trace(other, example_kwargs=inputs, frontend="export")
    assert len(exports) == 2 and len(list(tmp_path.glob("*.pt2"))) == 2
