"""``Plan(compile=True)`` against eager fxpar on real ranks: what the compile tests share.

Reads: a plan string, the zoo's tiny llama, and what Inductor made of each rank's stages: the generated
wrapper code (``run_and_get_code``) and, when asked, the post-grad graphs (a recording
``post_grad_custom_post_pass``, after fxpar's lowering and before Inductor's bucketing and scheduling).
Writes: nothing; :func:`compiled_vs_eager` returns plain numbers, so it can run on the ranks of a
:mod:`fxpar.testing.multiproc` pool.

Graph facts are read where they are decided: which tensors the forward saves for backward and which
gathers backward issues (the partitioner) from the post-grad graphs; how many collectives are launched
and what runs between a collective's start and its wait (bucketing, scheduling) from the wrapper code.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.fx

__all__ = ["compiled_vs_eager", "graph_facts", "graph_recorder", "overlapped"]

_funcol = torch.ops._c10d_functional
_STARTS = re.compile(r"_c10d_functional\.(all_reduce_|all_gather_into_tensor(?:_out)?|reduce_scatter_tensor)"
                     r"\.default\(")
_GATHERS = re.compile(r"_c10d_functional\.all_gather_into_tensor(?:_out)?\.default\(")
_COMPUTE = ("extern_kernels.", "cpp_fused_")
_COLLECTIVES = (_funcol.all_reduce.default, _funcol.all_gather_into_tensor.default,
                _funcol.reduce_scatter_tensor.default)


def overlapped(code: str) -> int:
    """How many collectives of a compiled wrapper have compute between their start and their wait (the
    compute cannot read the collective's result: it is not there before the wait)."""
    lines = code.splitlines()
    count = 0
    for i, line in enumerate(lines):
        if not _STARTS.search(line):
            continue
        buf = re.match(r"\s*(buf\d+) =", line) or re.search(r"\((?:reinterpret_tensor\()?(buf\d+)", line)
        name = buf.group(1)
        wait = next((j for j in range(i + 1, len(lines)) if "wait_tensor" in lines[j]
                     and re.search(rf"\b{name}\b", lines[j])), None)
        assert wait is not None, f"no wait for {name}"
        count += any(c in ln for ln in lines[i + 1:wait] for c in _COMPUTE)
    return count


def _is_view(node: torch.fx.Node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is torch.ops.aten.reshape.default


def _from_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a graph input, possibly cast (a ZeRO-3 shard as the lowering gathers it)."""
    while node.op == "call_function" and node.target is torch.ops.prims.convert_element_type.default:
        node = node.args[0]
    return node.op == "placeholder"


def graph_facts(graph: torch.fx.Graph) -> dict:
    """What a post-grad graph says about ZeRO-3 and overlap:

    * ``backward``: it has tangent inputs;
    * ``input_gathers``: numels of the all-gathers of a graph input (ZeRO-3 shards);
    * ``saved_gathered``: outputs that are a gathered tensor or a view of one (in a forward graph the
      outputs past the user's are what it saves for backward);
    * ``overlapped``: collectives with compute between their start and their wait that does not depend
      on them (in graph order, which Inductor's scheduler may only improve)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waits = {n.args[0]: n for n in nodes if n.target is _funcol.wait_tensor.default}
    gathered = set()
    for start in nodes:
        if start.target is _funcol.all_gather_into_tensor.default and start in waits:
            todo = [waits[start]]
            while todo:
                n = todo.pop()
                gathered.add(n)
                todo.extend(u for u in n.users if _is_view(u))
    outs = next(n for n in nodes if n.op == "output").all_input_nodes
    overlap = 0
    for start in nodes:
        if start.target not in _COLLECTIVES or start not in waits:
            continue
        dependents, todo = set(), [start]
        while todo:  # everything downstream of the collective
            n = todo.pop()
            for u in n.users:
                if u not in dependents:
                    dependents.add(u)
                    todo.append(u)
        between = nodes[index[start] + 1:index[waits[start]]]
        overlap += any(n.op == "call_function" and n not in dependents and not _is_view(n)
                       and getattr(n.target, "namespace", "") != "_c10d_functional" for n in between)
    return {"backward": any(n.op == "placeholder" and n.name.startswith("tangents") for n in nodes),
            "input_gathers": [n.args[0].meta["val"].numel() for n in nodes
                              if n.target is _funcol.all_gather_into_tensor.default and _from_input(n.args[0])],
            "saved_gathered": sum(o in gathered for o in outs),
            "overlapped": overlap}


def graph_recorder():
    """A ``post_grad_custom_post_pass`` keeping :func:`graph_facts` of every graph it sees. Its ``uuid``
    is None: Inductor's caches are bypassed, so no graph escapes it (and each compiles from cold)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Recorder(CustomGraphPass):
        def __init__(self):
            self.facts: list[dict] = []

        def __call__(self, graph: torch.fx.Graph) -> None:
            self.facts.append(graph_facts(graph))

        def uuid(self):
            return None

    return _Recorder()


def compiled_vs_eager(plan: str, steps: int, *, record: bool = False, layers: int = 2, batch: int = 2) -> dict:
    """Train the same tiny llama (``layers`` layers, ``batch`` x 8 tokens) ``steps`` steps under ``plan``
    eagerly and compiled: the largest loss
    and gradient differences, what the compiled code calls, and the fxpar ops left in the IR; with
    ``record``, the :func:`graph_facts` of every post-grad graph (``graphs``)."""
    from torch._inductor.utils import run_and_get_code

    import fxpar
    from fxpar import zoo
    from fxpar.ir.ops import count_collectives
    from fxpar.ir.plan import Plan

    name, cfg = "llama", dict(num_hidden_layers=layers)
    inputs = zoo.example_inputs(name, zoo.tiny_config(name, **cfg), batch=batch, seq=8)
    runs, codes = {}, []
    recorder = graph_recorder() if record else None
    for flag in (False, True):
        model = fxpar.compile(zoo.build(name, seed=0, **cfg), Plan.parse(plan + f",compile={flag}"),
                              example_kwargs=inputs, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout=300)
        with warnings.catch_warnings(), torch._inductor.config.patch(post_grad_custom_post_pass=recorder):
            # a fallback to eager would be a failure here (only fxpar's warning: torch may warn on its own)
            warnings.filterwarnings("error", message="fxpar: stage", category=RuntimeWarning)
            losses = []
            for i in range(steps):
                if flag and i == 0:
                    loss, codes = run_and_get_code(model.step, **inputs)
                else:
                    loss = model.step(**inputs)
                losses.append(loss.item())
        runs[flag] = (losses, model.full_state_dict(grads=True), model)
    (l0, g0, _), (l1, g1, compiled) = runs[False], runs[True]
    ir = [count_collectives(s.gm) for s in compiled.pipeline.stages_of(compiled.pp_rank)]
    return {"loss": max(abs(a - b) for a, b in zip(l0, l1)),
            "grads": max((g0[k] - g1[k]).abs().max().item() for k in g0),
            "same_keys": sorted(g0) == sorted(g1), "losses": l1,
            "ir_collectives": sum(sum(c.values()) for c in ir),
            "ir_param_gathers": sum(c.get("gather_params", 0) for c in ir),
            "codes": len(codes), "fxpar_calls": sum(c.count("torch.ops.fxpar.") for c in codes),
            "funcol_calls": sum(len(_STARTS.findall(c)) for c in codes),
            "code_gathers": [len(_GATHERS.findall(c)) for c in codes],
            "opaque_param_gathers": [c.count("torch.ops.fxpar.gather_params.default(") for c in codes],
            "overlapped": [overlapped(c) for c in codes],
            "graphs": recorder.facts if record else None}
