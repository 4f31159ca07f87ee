"""Every torch.distributed collective of fxpar goes through the wire of its communication pattern
(fxpar.runtime.dist_calls: a bounded wait, a CollectiveError naming the call, group, ranks and shape): a
lint over the product code's syntax trees, every wire call keyed by a pattern of the records, and the
wrapper's error on a failing call."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("fxpar", "passes", "runtime")
CALLS = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
         "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
         "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "reduce",
         "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"}
# the modules that may call them, and why
ALLOWED = {
    "runtime/dist_calls.py": "the wire of every communication pattern of fxpar.ir.collectives.COMMS, each call "
                             "wrapped; the records' kernels, the collective matmuls, the pipeline and the rest of "
                             "the runtime call it",
    "runtime/calibrate.py": "fxpar calibrate times the raw calls",
    "runtime/calibrate_runtime.py": "fxpar calibrate times the raw calls",
    "fxpar/cli/calibrate_pipeline.py": "fxpar calibrate times the raw calls",
}


def _dist_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed (``import torch.distributed as dist``), and collectives imported
    from it by name or bound to a module-level name (``ALL_GATHER = dist.all_gather_into_tensor``)."""
    modules, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            direct |= {a.asname or a.name for a in node.names if a.name in CALLS}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(_taken(n, modules) for n in ast.walk(node.value)):
            direct |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return modules, direct


def _is_dist(v: ast.AST, modules: set[str]) -> bool:
    return (isinstance(v, ast.Name) and v.id in modules) or ast.unparse(v) == "torch.distributed"


def _taken(node: ast.AST, modules: set[str]) -> bool:
    """``dist.<collective>`` or ``getattr(dist, "<collective>")``."""
    if isinstance(node, ast.Attribute):
        return node.attr in CALLS and _is_dist(node.value, modules)
    return (isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) > 1
            and _is_dist(node.args[0], modules) and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CALLS)


def _calls(path: Path, tree: ast.AST | None = None) -> list[str]:
    """The calls of torch.distributed collectives in ``path`` (or in ``tree``, a part of it), then the
    collectives taken without a call (``f = dist.all_gather_into_tensor``, ``getattr(dist, "...")``)."""
    module = ast.parse(path.read_text())
    modules, direct = _dist_names(module)
    tree = tree or module
    found, called = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        called.add(id(f))
        if isinstance(f, ast.Attribute) and f.attr in CALLS and _is_dist(f.value, modules):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(f)}")
        elif isinstance(f, ast.Name) and f.id in direct:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {f.id}")
    found += [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
              if id(node) not in called and _taken(node, modules)]
    return found


def test_no_collective_outside_the_wrappers():
    files = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "testing" not in p.relative_to(ROOT).parts]
    assert len(files) > 100
    stray = [c for p in files if str(p.relative_to(ROOT)) not in ALLOWED for c in _calls(p)]
    assert not stray, "call these through fxpar.runtime.dist_calls (or an IR op):\n" + "\n".join(stray)
    assert all((ROOT / p).exists() for p in ALLOWED)


def test_every_wire_call_belongs_to_a_pattern():
    """fxpar.runtime.dist_calls keys each of its calls by a communication pattern of the records
    (fxpar.ir.collectives.COMMS), and only those functions call torch.distributed."""
    from fxpar.ir.collectives import COMMS
    from fxpar.runtime import dist_calls

    keyed = [name for names in dist_calls.WIRES.values() for name in names]
    assert set(dist_calls.WIRES) == set(COMMS)
    assert sorted(keyed) == sorted(set(dist_calls.__all__) - {"WIRES", "Pending", "run"})
    path = ROOT / "runtime" / "dist_calls.py"
    calling = {f.name for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef)
               and _calls(path, f)}
    assert calling == set(keyed)


def _lint(tmp_path, code: str) -> list[str]:
    """What the lint finds in ``code`` written as a module of ``tmp_path`` (the calls, without their places)."""
    global ROOT
    (tmp_path / "m.py").write_text(code)
    saved, ROOT = ROOT, tmp_path
    try:
        return [c.split(" ", 1)[1] for c in _calls(tmp_path / "m.py")]
    finally:
        ROOT = saved


def test_the_lint_sees_a_collective_taken_without_a_call(tmp_path):
    code = ("import torch.distributed as dist\nf = dist.all_gather_into_tensor\n"
            "g = getattr(dist, 'reduce_scatter_single', None)\nop = dist.ReduceOp.SUM\ng(x, y)\n")
    assert _lint(tmp_path, code) == ["g", "dist.all_gather_into_tensor", "getattr(dist, 'reduce_scatter_single', None)"]


def test_the_lint_sees_each_way_of_calling(tmp_path):
    code = ("import torch.distributed as dist\nimport torch\nfrom torch.distributed import all_reduce as ar\n"
            "dist.all_reduce(x)\ntorch.distributed.barrier()\nar(x)\ndist.get_rank()\n")
    assert _lint(tmp_path, code) == ["dist.all_reduce", "torch.distributed.barrier", "ar"]


def test_a_failing_call_is_a_collective_error(monkeypatch):
    import torch.distributed as dist

    from fxpar.ir.errors import CollectiveError
    from fxpar.runtime import dist_calls

    class Work:
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: Work())
    monkeypatch.setattr(dist_calls, "_ranks", lambda group: [0, 1])
    pending = dist_calls.all_reduce(torch.zeros(3, 2), "dp", async_op=True)
    with pytest.raises(CollectiveError,
                       match=r"all_reduce on group 'dp'.*shape \(3, 2\).*ranks \[0, 1\].*closed by peer"):
        pending.wait()
    pending.wait()  # waited once: a second wait is a no-op
