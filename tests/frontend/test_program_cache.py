"""The program cache (``FXPAR_PROGRAM_CACHE``): a second trace of an unchanged model loads the program the
first one saved instead of calling torch.export, and gives the same graph (every node's meta included),
loss and gradients; a changed config value (a private one too) or module attribute traces again; a model
whose behaviour the key cannot read (a class made inside a function) is never kept; ranks tracing the same
program at once trace it once."""

from __future__ import annotations

import os

import torch

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc
from fxpar.testing.compare import grads_by_fqn

pool2 = multiproc.rank_pool(2)


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
    assert len(exports) == 1 and len(list(tmp_path.glob("*.pkl"))) == 1
    cached = fxpar.trace(model, example_kwargs=inputs, frontend="export")
    assert len(exports) == 1, "the second trace called torch.export instead of loading the saved program"
    assert str(cached.gm.graph) == str(fresh.gm.graph)
    assert cached.gm.code == fresh.gm.code
    for a, b in zip(fresh.gm.graph.nodes, cached.gm.graph.nodes, strict=True):  # torch's own pickling drops meta
        assert a.meta.keys() == b.meta.keys(), a.name
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack"), a.name
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype, va.device) == (vb.shape, vb.stride(), vb.dtype, vb.device)

    loss, grads = _loss_and_grads(fresh, model, inputs)
    loss_c, grads_c = _loss_and_grads(cached, model, inputs)
    assert torch.equal(loss_c, loss)
    assert grads_c.keys() == grads.keys() and all(torch.equal(grads_c[k], grads[k]) for k in grads)

    other = zoo.build("llama", seed=0, num_hidden_layers=1, rms_norm_eps=1e-3)  # same tensors, one config value changed
    fxpar.trace(other, example_kwargs=inputs, frontend="export")
    assert len(exports) == 2 and len(list(tmp_path.glob("*.pkl"))) == 2


def test_another_attention_implementation_traces_again(monkeypatch, tmp_path):
    """``config._attn_implementation`` is a private setting the config's JSON leaves out: eager attention
    and SDPA trace to different graphs, so the key holds it."""
    monkeypatch.setenv("FXPAR_PROGRAM_CACHE", str(tmp_path))
    exports = _counting_exports(monkeypatch)
    inputs = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    graphs = {}
    for kind in ("sdpa", "eager"):
        model = zoo.build("llama", seed=0, num_hidden_layers=1)
        model.config._attn_implementation = kind
        graphs[kind] = fxpar.trace(model, example_kwargs=inputs, frontend="export").gm.graph
    assert len(exports) == 2
    assert any("scaled_dot_product" in str(n.target) for n in graphs["sdpa"].nodes)
    assert not any("scaled_dot_product" in str(n.target) for n in graphs["eager"].nodes)


def _scaled(factor: float) -> torch.nn.Module:
    class Scaled(torch.nn.Module):  # one name, one source, a behaviour from the call: no key can tell two apart
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * factor

    return Scaled()


def _two_scales_traced(monkeypatch, tmp_path, make) -> list:
    """Trace ``make(2.0)`` and ``make(3.0)`` (same weights) with the cache in ``tmp_path``; each program must
    compute its own model's output. Returns the exports counter."""
    monkeypatch.setenv("FXPAR_PROGRAM_CACHE", str(tmp_path))
    exports = _counting_exports(monkeypatch)
    x = torch.randn(2, 4)
    twice, thrice = make(2.0), make(3.0)
    thrice.load_state_dict(twice.state_dict())
    assert torch.allclose(fxpar.trace(twice, (x,))(x), twice(x))
    assert torch.allclose(fxpar.trace(thrice, (x,))(x), thrice(x))
    return exports


def test_a_class_made_inside_a_function_is_traced_every_time(monkeypatch, tmp_path):
    exports = _two_scales_traced(monkeypatch, tmp_path, _scaled)
    assert len(exports) == 2 and not list(tmp_path.glob("*.pkl"))


def test_a_deep_program_is_kept(monkeypatch, tmp_path):
    """Pickled node by node, a graph recursed as deep as it is long: 8 Llama layers passed Python's limit."""
    model = zoo.build("llama", seed=0, num_hidden_layers=12)
    _kept_and_loaded(monkeypatch, tmp_path, model, zoo.example_inputs("llama", model, batch=1, seq=4))


def _kept_and_loaded(monkeypatch, tmp_path, model, inputs) -> None:
    """The first trace writes the program, the second loads it: one export, the same code and loss."""
    monkeypatch.setenv("FXPAR_PROGRAM_CACHE", str(tmp_path))
    exports = _counting_exports(monkeypatch)
    fresh = fxpar.trace(model, example_kwargs=inputs)
    assert len(list(tmp_path.glob("*.pkl"))) == 1, "the program was not written"
    cached = fxpar.trace(model, example_kwargs=inputs)
    assert len(exports) == 1 and cached.gm.code == fresh.gm.code
    assert torch.equal(cached(**inputs).loss, fresh(**inputs).loss)


class _DictScaled(torch.nn.Module):
    """Its factor in a dict, as PEFT keeps ``scaling`` (rsLoRA changes the number, not the code)."""

    def __init__(self, factor: float):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scaling = {"default": factor}

    def forward(self, x):
        return self.lin(x) * self.scaling["default"]


def test_an_attribute_in_a_container_is_part_of_the_key(monkeypatch, tmp_path):
    exports = _two_scales_traced(monkeypatch, tmp_path, _DictScaled)
    assert len(exports) == 2 and len(list(tmp_path.glob("*.pkl"))) == 2
    fxpar.trace(_DictScaled(3.0), (torch.randn(2, 4),))
    assert len(exports) == 2, "an equal model traced again"


def _trace_counting_exports(directory: str) -> int:
    saved = os.environ.get("FXPAR_PROGRAM_CACHE")  # ./dev test's own, for the pool's later cases
    os.environ["FXPAR_PROGRAM_CACHE"] = directory
    calls = []
    real = torch.export.export
    torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model = zoo.build("llama", seed=0, num_hidden_layers=1)
        inputs = zoo.example_inputs("llama", model, batch=2, seq=8)
        program = fxpar.trace(model, example_kwargs=inputs)
        assert torch.equal(program(**inputs).loss, model(**inputs).loss)
    finally:
        torch.export.export = real
        if saved is None:
            del os.environ["FXPAR_PROGRAM_CACHE"]
        else:
            os.environ["FXPAR_PROGRAM_CACHE"] = saved
    return len(calls)


def test_ranks_tracing_one_program_at_once_trace_it_once(pool2, tmp_path):
    assert sorted(pool2.run(_trace_counting_exports, str(tmp_path), timeout=120)) == [0, 1]


def test_a_microbatch_sliced_from_its_batch_is_kept(monkeypatch, tmp_path):
    """A pipeline's or gradient accumulation's microbatch is a view into the batch: export gives its base a
    symbolic size, which had kept every microbatched compile out of the cache."""
    model = zoo.build("llama", seed=0, num_hidden_layers=1)
    batch = zoo.example_inputs("llama", model, batch=4, seq=8)
    micro = {k: v.chunk(2)[1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # views, at an offset
    _kept_and_loaded(monkeypatch, tmp_path, model, micro)
