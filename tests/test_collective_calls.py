"""Every torch.distributed collective of fxpar goes through the modules that wrap it (a bounded wait, a
CollectiveError naming the call, group, ranks and shape): a lint over the product code's syntax trees,
and the wrapper's error on a failing call."""

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
    "runtime/collectives.py": "the kernels of the IR's collective ops (EP's all-to-alls included): one per pattern",
    "runtime/dist_calls.py": "the runtime's other collectives, wrapped",
    "runtime/kernels/collective_matmul.py": "the chunked collectives of its ops, inside its _start/_finish",
    "runtime/pipeline.py": "the pipeline's transfers: their waits raise a PipelineError naming stage, microbatch, peer",
    "runtime/calibrate.py": "fxpar calibrate times the raw calls",
    "runtime/calibrate_runtime.py": "fxpar calibrate times the raw calls",
    "fxpar/cli/calibrate_pipeline.py": "fxpar calibrate times the raw calls",
}


def _dist_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed (``import torch.distributed as dist``) and collectives imported
    from it by name."""
    modules, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            direct |= {a.asname or a.name for a in node.names if a.name in CALLS}
    return modules, direct


def _calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, direct = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in CALLS and (
                (isinstance(f.value, ast.Name) and f.value.id in modules)
                or ast.unparse(f.value) == "torch.distributed"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(f)}")
        elif isinstance(f, ast.Name) and f.id in direct:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {f.id}")
    return found


def test_no_collective_outside_the_wrappers():
    files = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "testing" not in p.relative_to(ROOT).parts]
    assert len(files) > 100
    stray = [c for p in files if str(p.relative_to(ROOT)) not in ALLOWED for c in _calls(p)]
    assert not stray, "call these through fxpar.runtime.dist_calls (or an IR op):\n" + "\n".join(stray)
    assert all((ROOT / p).exists() for p in ALLOWED)


def test_the_lint_sees_each_way_of_calling(tmp_path):
    code = ("import torch.distributed as dist\nimport torch\nfrom torch.distributed import all_reduce as ar\n"
            "dist.all_reduce(x)\ntorch.distributed.barrier()\nar(x)\ndist.get_rank()\n")
    (tmp_path / "m.py").write_text(code)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [c.split(" ", 1)[1] for c in _calls(tmp_path / "m.py")] == [
            "dist.all_reduce", "torch.distributed.barrier", "ar"]
    finally:
        ROOT = saved


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
