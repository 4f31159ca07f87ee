"""The import rules of ARCHITECTURE.md, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# layer -> the fxpar layers it may import (besides itself)
ALLOWED = {
    "fxpar.ir": set(),
    "fxpar.frontend": {"fxpar.ir"},
    "fxpar.cost": {"fxpar.ir"},
    "fxpar.inspect": {"fxpar.ir", "fxpar.runtime.ops"},
    "fxpar.passes": {"fxpar.ir", "fxpar.cost", "fxpar.runtime.ops"},
    "fxpar.runtime": {"fxpar.ir"},
    "fxpar.testing": {"fxpar.ir", "fxpar.frontend", "fxpar.cost", "fxpar.inspect", "fxpar.passes",
                      "fxpar.runtime", "fxpar.api", "fxpar"},
}
DIRS = {"fxpar.passes": ROOT / "passes", "fxpar.runtime": ROOT / "runtime"}


def _layer_files():
    for layer in ALLOWED:
        base = DIRS.get(layer) or ROOT / Path(*layer.split("."))
        for f in sorted(base.rglob("*.py")):
            yield layer, f


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # "from fxpar.runtime import ops" imports fxpar.runtime.ops
                yield node.lineno, f"{node.module}.{a.name}"


def _permitted(layer: str, target: str) -> bool:
    if not (target == "fxpar" or target.startswith("fxpar.")):
        return True
    if target == layer or target.startswith(layer + "."):
        return True
    for allowed in ALLOWED[layer]:
        if target == allowed or target.startswith(allowed + "."):
            return True
    # "from fxpar.ir import x" yields "fxpar.ir" and "fxpar.ir.x"; the bare package "fxpar" is the api
    return False


def test_layering_rules_hold():
    bad = []
    for layer, f in _layer_files():
        for lineno, target in _imports(f):
            if target == "fxpar" and layer != "fxpar.testing":
                bad.append(f"{f.relative_to(ROOT)}:{lineno} imports the top-level fxpar package")
            elif target != "fxpar" and not _permitted(layer, target):
                # "from fxpar.ir.program import Program" also yields "fxpar.ir.program.Program": fine
                bad.append(f"{f.relative_to(ROOT)}:{lineno} ({layer}) imports {target}")
    assert not bad, "layering violations (see ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_bare_passes_or_runtime_imports():
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") or part in ("build",) for part in f.relative_to(ROOT).parts):
            continue
        for lineno, target in _imports(f):
            if target.split(".")[0] in ("passes", "runtime"):
                bad.append(f"{f.relative_to(ROOT)}:{lineno} imports {target}; use fxpar.{target}")
    assert not bad, "\n".join(bad)


def test_checker_catches_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from fxpar.passes import tp\nimport fxpar.cost.flops\n")
    found = [t for _, t in _imports(f)]
    assert found[0] == "fxpar.passes.tp" and not _permitted("fxpar.ir", found[0])
    assert not _permitted("fxpar.runtime", "fxpar.cost.flops")
    assert _permitted("fxpar.passes", "fxpar.runtime.ops")
    assert not _permitted("fxpar.passes", "fxpar.runtime.pipeline")
