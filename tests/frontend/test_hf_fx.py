"""The hf_fx frontend: HFTracer (transformers.utils.fx) lowered to the same ExportedProgram as ``export``.

Needs transformers < 5 (HFTracer was removed in 5.x, and traces most decoders only before 4.48): run it
in the second environment, e.g. ``.venv-hf447`` with transformers 4.47.1. Elsewhere the whole file skips.
"""

from __future__ import annotations

import re

import pytest

transformers = pytest.importorskip("transformers")
try:
    from transformers.utils import fx as _hf_fx_module

    _HAVE_HF_FX = hasattr(_hf_fx_module, "HFTracer")
except Exception:  # transformers >= 5: the module is gone
    _HAVE_HF_FX = False
if not _HAVE_HF_FX:
    pytest.skip(f"transformers {transformers.__version__} has no transformers.utils.fx (HFTracer exists "
                "only in transformers < 5); run this file in the hf_fx environment (transformers 4.47.1)",
                allow_module_level=True)

import torch  # noqa: E402

import fxpar  # noqa: E402
from fxpar import zoo  # noqa: E402
from fxpar.frontend import hf_fx  # noqa: E402
from fxpar.ir import meta  # noqa: E402
from fxpar.ir.errors import TraceError  # noqa: E402

pytestmark = pytest.mark.hf_fx

# Architectures HFTracer captures on transformers 4.47.1; the second group is outside its supported
# list (transformers' own symbolic_trace refuses them unless disable_check=True) but traces fine.
SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "opt", "mixtral", "qwen2_moe", "bloom", "bert", "t5",
             "bart")
NEEDS_DISABLE_CHECK = ("gemma", "phi", "phi3", "falcon", "olmo")
# HFTracer cannot trace these (module where it fails, on 4.47.1).
UNSUPPORTED = {"gemma2": "model.layers.0", "gpt_neox": "gpt_neox.layers.0.attention"}

TOL = 1e-6
_CALL_SUFFIX = re.compile(r"@\d+$")


def _root_entry(model):
    cls = type(model)
    return ("", f"{cls.__module__}.{cls.__qualname__}")


def _tensor_fqns(model) -> set[str]:
    return ({n for n, _ in model.named_parameters(remove_duplicate=False)}
            | {n for n, _ in model.named_buffers(remove_duplicate=False)})


def _check_module_stacks(ep, model) -> None:
    """Every call_function node: a stack in export's format, rooted at the model, of real modules."""
    modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    root = _root_entry(model)
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack")
        assert stack, f"{node.name} has no nn_module_stack"
        values = list(stack.values())
        assert values[0] == root, (node.name, values[0])
        for key, (path, cls) in stack.items():
            assert isinstance(key, str) and isinstance(path, str) and isinstance(cls, str)
            assert _CALL_SUFFIX.sub("", path) in modules, f"{node.name}: {path!r} is not a module"


@pytest.mark.parametrize("name", SUPPORTED + NEEDS_DISABLE_CHECK)
def test_reproduces_eager_forward_and_backward(name):
    """fxpar.trace(frontend="hf_fx") gives a Program that matches eager: loss, logits, every gradient."""
    model = zoo.build(name)  # train() mode, every dropout 0.0
    kwargs = zoo.example_inputs(name, model)
    children, use_cache = set(model._modules), getattr(model.config, "use_cache", None)

    eager = model(**kwargs)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    program = fxpar.trace(model, (), kwargs, frontend="hf_fx")
    assert program.frontend == "hf_fx"
    info = program.gm.meta[hf_fx.META_KEY]
    assert info["disable_check"] == (name in NEEDS_DISABLE_CHECK)
    # the user's model is left as it was (HFTracer inserts stateless modules and flips use_cache)
    assert set(model._modules) == children
    assert getattr(model.config, "use_cache", None) == use_cache
    # every parameter and buffer under its original FQN(s), tied ones as one parameter with aliases
    assert {f for p in program.params.values() for f in p.fqns} == _tensor_fqns(model)
    # every node owned by a real module of the model, as with the export frontend
    modules = {n for n, _ in model.named_modules()}
    assert all(n.meta[meta.MODULE] in modules for n in program.nodes() if n.op == "call_function")

    out = program(**kwargs)
    # the model's own output type, same fields
    assert type(out) is type(eager)
    assert list(out.keys()) == list(eager.keys())
    assert (out.loss - eager.loss).abs().item() <= TOL
    assert (out.logits - eager.logits).abs().max().item() <= TOL

    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(eager_grads)
    for fqn, g in eager_grads.items():
        assert grads[fqn] is not None, fqn
        assert (grads[fqn] - g).abs().max().item() <= TOL, fqn


@pytest.mark.parametrize("name", ["llama", "t5", "bert"])
def test_stock_config_traces_without_its_cache(name):
    """A stock config (use_cache=True, the transformers default) traced with the user's batch alone
    (no use_cache): the program equals eager with use_cache=False, and every config reads as before."""
    model = zoo.build(name, stock=True)
    kwargs = zoo.example_inputs(name, model, stock=True)
    assert "use_cache" not in kwargs and model.config.use_cache is True
    before = [(n, m.config.use_cache) for n, m in model.named_modules() if hasattr(m, "config")]
    program = fxpar.trace(model, (), kwargs, frontend="hf_fx")
    assert [(n, m.config.use_cache) for n, m in model.named_modules() if hasattr(m, "config")] == before
    out = program(**kwargs)
    assert "past_key_values" not in out.keys()
    eager = model(**kwargs, **({"use_cache": False} if "use_cache" in model.forward.__code__.co_varnames else {}))
    assert (out.loss - eager.loss).abs().item() <= TOL
    assert (out.logits - eager.logits).abs().max().item() <= TOL


def test_a_failing_trace_restores_use_cache():
    """HFTracer failing inside forward: the config turned off for the trace reads True again."""
    model = zoo.build("llama", stock=True)
    seen = []

    def fail(module, args):
        seen.append(model.config.use_cache)
        raise RuntimeError("a failure inside the traced forward")

    model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(TraceError):
        hf_fx.capture_hf_fx(model, (), zoo.example_inputs("llama", model, stock=True))
    assert seen == [False] and model.config.use_cache is True


def test_captured_program_keeps_export_stack_format():
    model = zoo.build("llama")
    ep = hf_fx.capture_hf_fx(model, (), zoo.example_inputs("llama", model))
    _check_module_stacks(ep, model)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_untraceable_models_raise_trace_error(name):
    model = zoo.build(name)
    arange = torch.arange
    with pytest.raises(TraceError) as info:
        hf_fx.capture_hf_fx(model, (), zoo.example_inputs(name, model))
    err = info.value
    assert err.frontend == "hf_fx"
    assert err.module == UNSUPPORTED[name]
    assert err.module in dict(model.named_modules())
    assert err.op and ".py:" in err.op  # the model-code line that failed
    assert str(err).rstrip().endswith("use frontend='export'")
    assert torch.arange is arange  # HFTracer's patches of torch functions are undone after a failure


def test_same_ir_as_export_on_tied_llama():
    """Module stacks down to the attention code, tied weights, signature and specs as torch.export."""
    model = zoo.build("llama", tie_word_embeddings=True)
    kwargs = zoo.example_inputs("llama", model)
    ep = hf_fx.capture_hf_fx(model, (), kwargs)

    innermost = {}
    for node in ep.graph.nodes:
        if node.op == "call_function":
            innermost.setdefault(list(node.meta["nn_module_stack"].values())[-1][0], []).append(node)
    attn = "model.layers.0.self_attn"
    # the attention's own Python code (not only its Linear submodules) is filed under it
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default
               or "softmax" in str(n.target) for n in innermost[attn])
    q = innermost[attn + ".q_proj"][0]
    assert [p for p, _ in q.meta["nn_module_stack"].values()] == [
        "", "model", "model.layers.0", attn, attn + ".q_proj"]

    # tied weights: one placeholder per FQN, both bound to the same tensor
    tied_fqns = ("lm_head.weight", "model.embed_tokens.weight")
    tied = [s for s in ep.graph_signature.input_specs if s.target in tied_fqns]
    assert len(tied) == 2 and tied[0].arg.name != tied[1].arg.name
    assert ep.state_dict["lm_head.weight"] is ep.state_dict["model.embed_tokens.weight"]

    reference = torch.export.export(model, (), kwargs, strict=False)

    def specs(e):
        return sorted((s.kind.name, s.target, s.persistent)
                      for s in e.graph_signature.input_specs if s.target)

    def modules(e):
        return {list(n.meta["nn_module_stack"].values())[-1][0]
                for n in e.graph.nodes if n.op == "call_function"}

    assert specs(ep) == specs(reference)
    assert ep.call_spec.in_spec == reference.call_spec.in_spec
    assert ep.call_spec.out_spec == reference.call_spec.out_spec
    assert modules(ep) == modules(reference)


def test_meta_device_llama_captures():
    model = zoo.build("llama", device="meta")
    kwargs = zoo.example_inputs("llama", model)
    assert kwargs["input_ids"].device.type == "meta"
    ep = hf_fx.capture_hf_fx(model, (), kwargs)
    assert all(t.device.type == "meta" for t in ep.state_dict.values())
    targets = {s.target for s in ep.graph_signature.input_specs if s.target}
    assert "model.layers.1.mlp.down_proj.weight" in targets
    _check_module_stacks(ep, model)


def test_positional_args_and_constant_kwargs_keep_the_call_structure():
    model = zoo.build("gpt2")
    kwargs = zoo.example_inputs("gpt2", model)
    ids = kwargs.pop("input_ids")
    ep = hf_fx.capture_hf_fx(model, (ids,), kwargs)  # use_cache=False stays a (constant) keyword input
    args_spec, kwargs_spec = ep.call_spec.in_spec.children()
    assert args_spec.num_leaves == 1 and kwargs_spec.context == ["labels", "use_cache"]
    out = ep.module()(ids, **kwargs)
    assert (out.loss - model(ids, **kwargs).loss).abs().item() <= TOL


def test_dynamic_batch():
    model = zoo.build("llama")
    kwargs = zoo.example_inputs("llama", model)
    batch = torch.export.Dim("batch")
    shapes = {k: ({0: batch} if isinstance(v, torch.Tensor) else None) for k, v in kwargs.items()}
    ep = hf_fx.capture_hf_fx(model, (), kwargs, dynamic_shapes=shapes)
    other = zoo.example_inputs("llama", model, batch=3, seed=1)
    assert (ep.module()(**other).logits - model(**other).logits).abs().max().item() <= TOL


def test_bad_arguments_raise_trace_error():
    model = zoo.build("gpt2")
    ids = zoo.example_inputs("gpt2", model)["input_ids"]
    with pytest.raises(TraceError, match="plain Python constants"):
        hf_fx.capture_hf_fx(model, (), {"input_ids": ids, "past_key_values": ((ids, ids),)})
    with pytest.raises(TraceError, match="no named parameter"):
        hf_fx.capture_hf_fx(model, (), {"input_ids": ids, "not_an_argument": ids})


def test_available():
    assert hf_fx.available()
    assert hf_fx.unavailable_reason() == ""
