"""The export frontend on the whole zoo: the traced program reproduces eager, forward and backward.

Each case runs the model eagerly in train mode with labels, then the traced program on the same
parameters, and compares loss, logits and every parameter's gradient (by FQN). Also: dynamic batch
and sequence dims, meta-device models, dropout under a fixed seed, and the errors a failing trace gives.
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.ir import meta
from fxpar.testing.compare import grads_by_fqn, max_abs_diff_tree

TOL = 1e-6
# figures measured by the last run; the closing note quotes them
MEASURED: dict[str, tuple[float, float, float]] = {}


def _fwd_bwd(fn, model, inputs):
    model.zero_grad(set_to_none=True)
    out = fn(**inputs)
    out.loss.backward()
    return out, grads_by_fqn(model)


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_traced_program_reproduces_eager(name):
    model = zoo.build(name, seed=0)
    inputs = zoo.example_inputs(name, model, batch=2, seq=8)
    ref, ref_grads = _fwd_bwd(model, model, inputs)
    program = fxpar.trace(model, example_kwargs=inputs, frontend="export")
    assert program.frontend == "export"
    out, grads = _fwd_bwd(program, model, inputs)
    assert type(out) is type(ref)
    loss_diff = (out.loss - ref.loss).abs().item()
    logits_diff = max_abs_diff_tree(out.logits, ref.logits)
    assert set(grads) == set(ref_grads), f"gradients for different parameters: {set(grads) ^ set(ref_grads)}"
    grad_diff = max((max_abs_diff_tree(grads[k], ref_grads[k]) for k in ref_grads), default=0.0)
    MEASURED[name] = (loss_diff, logits_diff, grad_diff)
    print(f"{name}: |dloss| {loss_diff:.2e} |dlogits| {logits_diff:.2e} |dgrad| {grad_diff:.2e}")
    assert loss_diff <= TOL and logits_diff <= TOL and grad_diff <= TOL, MEASURED[name]


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_every_node_has_val_module_and_cost(name):
    model = zoo.build(name)
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs(name, model))
    modules = {n for n, _ in model.named_modules()}
    for node in program.nodes():
        if node.op in ("output", "get_attr"):
            continue
        assert meta.VAL in node.meta, node.format_node()
        assert node.meta[meta.MODULE] in modules, (node.format_node(), node.meta[meta.MODULE])
        assert meta.COST in node.meta, node.format_node()


def test_dropout_in_train_mode_matches_under_the_same_seed():
    model = zoo.build("gpt2", resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    inputs = zoo.example_inputs("gpt2", model)
    program = fxpar.trace(model, example_kwargs=inputs)
    torch.manual_seed(123)
    ref, ref_grads = _fwd_bwd(model, model, inputs)
    torch.manual_seed(123)
    out, grads = _fwd_bwd(program, model, inputs)
    torch.manual_seed(124)
    other = program(**inputs)
    assert (out.loss - ref.loss).abs().item() <= TOL
    assert max(max_abs_diff_tree(grads[k], ref_grads[k]) for k in ref_grads) <= TOL
    assert (other.loss - ref.loss).abs().item() > 0, "dropout did not act in the traced program"


def test_dynamic_batch_and_sequence():
    model = zoo.build("llama")
    inputs = zoo.example_inputs("llama", model, batch=2, seq=8)
    program = fxpar.trace(model, example_kwargs=inputs, dynamic=True)
    for batch, seq in ((3, 5), (1, 16)):
        other = zoo.example_inputs("llama", model, batch=batch, seq=seq, seed=1)
        ref = model(**other)
        out = program(**other)
        assert out.logits.shape == (batch, seq, model.config.vocab_size)
        assert max_abs_diff_tree(out.logits, ref.logits) <= TOL
    static = fxpar.trace(model, example_kwargs=inputs)
    with pytest.raises(Exception):
        static(**zoo.example_inputs("llama", model, batch=3, seq=5))


def test_meta_device_model_traces_without_weights():
    model = zoo.build("llama", device="meta")
    assert all(p.is_meta for p in model.parameters())
    inputs = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
              for k, v in zoo.example_inputs("llama", zoo.tiny_config("llama")).items()}
    program = fxpar.trace(model, example_kwargs=inputs)
    report = fxpar.inspect(program, quiet=True)
    assert report.total.flops > 0
    assert report.total.params == sum(p.numel() for p in model.parameters())


def test_tied_weights_are_one_parameter_with_two_fqns():
    model = zoo.build("llama", tie_word_embeddings=True)
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model))
    assert program.tied_groups() == [("model.embed_tokens.weight", "lm_head.weight")]
    assert program.canonical("lm_head.weight") == "model.embed_tokens.weight"
    users = [n for n in program.graph.nodes if n.meta.get(meta.PARAM) == "model.embed_tokens.weight"]
    assert len(users) == 1 and len(users[0].users) == 2  # one placeholder read by embedding and lm_head
    untied = fxpar.trace(zoo.build("llama"), example_kwargs=zoo.example_inputs("llama", model))
    assert untied.tied_groups() == []


def test_hf_plans_are_read_with_the_prefix():
    model = zoo.build("llama")
    info = fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model)).info
    assert info.base_model_prefix == "model"
    assert info.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert info.tp_plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert "lm_head" in info.tp_plan
    assert set(info.pp_plan) >= {"model.embed_tokens", "model.layers", "model.norm"}
    assert info.tie_word_embeddings is False
    assert info.layer_container == "model.layers" and info.num_layers == 2


# ---- errors -----------------------------------------------------------------------------------------
class Inner(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), Inner())

    def forward(self, x):
        return self.block(x)


def test_error_names_module_operation_and_fix():
    with pytest.raises(fxpar.TraceError) as e:
        fxpar.trace(Outer(), (torch.randn(2, 4),), frontend="export")
    err = e.value
    assert err.module == "block.1"
    assert "x.sum() > 0" in err.op
    assert "constant" in err.hint
    assert "module: block.1" in str(err) and "fix:" in str(err)


def test_error_for_kv_cache_output_says_use_cache_false():
    """A call that asks for the cache itself (use_cache=True, no past_key_values) keeps it, and the cache
    output it returns is a TraceError naming the fix."""
    model = zoo.build("llama", stock=True)
    inputs = {**zoo.example_inputs("llama", model, stock=True), "use_cache": True}
    with pytest.raises(fxpar.TraceError, match="use_cache=False"):
        fxpar.trace(model, example_kwargs=inputs)
    assert model.config.use_cache is True


@pytest.mark.parametrize("name", ["llama", "bert", "t5"])
def test_stock_config_traces_without_its_cache(name):
    """A stock config (use_cache=True) traced with the user's batch alone: the program has no cache
    output, equals eager with use_cache=False, and the config reads True again after the trace; an
    inference call (no labels, eval mode) alike. bert's forward takes no use_cache; t5's cache is an
    encoder-decoder one held by a deep copy of the config in each stack."""
    model = zoo.build(name, stock=True)
    kw = zoo.example_inputs(name, model, stock=True)
    assert "use_cache" not in kw
    configs = lambda: [(n, getattr(m.config, "use_cache", None)) for n, m in model.named_modules()  # noqa: E731
                       if hasattr(m, "config")]
    before = configs()
    for inputs in (kw, {k: v for k, v in kw.items() if k != "labels"}):
        model.train("labels" in inputs)
        program = fxpar.trace(model, example_kwargs=inputs)
        assert model.config.use_cache is True and configs() == before
        out = program(**inputs)
        assert "past_key_values" not in out.keys()
        want = model(**inputs, **({"use_cache": False} if name != "bert" else {}))
        assert (out.logits - want.logits).abs().max().item() <= TOL


def test_cache_rule_reads_the_call():
    """The cache stays on where the call gives past_key_values or use_cache=True; otherwise every config
    holding a true use_cache (t5: the model's and the decoder's copy, not the encoder's False) is off."""
    from fxpar.frontend.kv_cache import cache_off_for_trace, call_values

    model = zoo.build("t5", stock=True)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for values, off in (({"input_ids": ids}, 2), ({"input_ids": ids, "use_cache": False}, 2),
                        ({"input_ids": ids, "past_key_values": None}, 2), ({"input_ids": ids, "use_cache": True}, 0),
                        ({"input_ids": ids, "past_key_values": object()}, 0)):
        with cache_off_for_trace(model, values) as turned:
            assert len(turned) == off and model.config.use_cache is (off == 0), values
        assert model.config.use_cache is True and model.decoder.config.use_cache is True
    assert call_values(model, (ids, ids), {"labels": ids}) == {"input_ids": ids, "attention_mask": ids, "labels": ids}


def test_a_failing_trace_restores_use_cache():
    """The configs turned off for a trace read True again when the trace fails; during it they read False."""
    model = zoo.build("t5", stock=True)
    seen = []

    def fail(module, args):
        seen.append((model.config.use_cache, model.decoder.config.use_cache))
        raise RuntimeError("a failure inside the traced forward")

    model.decoder.block[0].register_forward_pre_hook(fail)
    with pytest.raises(fxpar.TraceError, match="a failure inside the traced forward"):
        fxpar.trace(model, example_kwargs=zoo.example_inputs("t5", model, stock=True))
    assert seen == [(False, False)]
    assert model.config.use_cache is True and model.decoder.config.use_cache is True
    assert model.decoder.config is not model.config  # t5's stacks hold their own copy, restored too


def test_error_for_a_missing_argument():
    with pytest.raises(fxpar.TraceError, match="pass every required argument"):
        fxpar.trace(Outer(), (), {})


def test_calling_with_other_arguments_than_traced_is_a_clear_error():
    model = zoo.build("llama")
    inputs = zoo.example_inputs("llama", model)
    program = fxpar.trace(model, example_kwargs=inputs)
    with pytest.raises(TypeError, match="missing \\['labels'\\]"):
        program(**{k: v for k, v in inputs.items() if k != "labels"})


def test_stack_traces_only_when_asked():
    model = zoo.build("gpt2")
    inputs = zoo.example_inputs("gpt2", model)
    plain = fxpar.trace(model, example_kwargs=inputs)
    assert not any(n.meta.get("stack_trace") for n in plain.nodes())
    rich = fxpar.trace(model, example_kwargs=inputs, stack_traces=True)
    assert any("modeling_gpt2.py" in (n.meta.get("stack_trace") or "") for n in rich.nodes())
