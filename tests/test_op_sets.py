"""Every op set is declared once, in ``fxpar/ir/op_classes.py`` (docs/design.md), checked on the source.

A module-level ``set`` / ``frozenset`` / ``tuple`` / ``list`` of ATen ops (``aten.mm``,
``torch.ops.aten.mm.default``) or of qualified op names (``"aten::mm"``) anywhere else in the shipped
code fails: a copy there drifts from its twin (two ``_CACHE_WRITES``, three matmul sets did). Tables keyed
by op (``{aten.mm: ...}``) are rules, not sets, and stay beside the code that reads them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "fxpar" / "ir" / "op_classes.py"
PRODUCT = ("fxpar", "passes", "runtime")
_QUALIFIED = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*(\.\w+)?$")  # "aten::mm", "transformers::grouped_mm.default"
_COLLECTIONS = ("set", "frozenset", "tuple", "list")


def _is_op(node: ast.AST) -> bool:
    """An ATen op (``aten.x``, ``aten.x.default``, ``torch.ops.aten.x``) or a qualified op-name string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(_QUALIFIED.match(node.value))
    if not isinstance(node, ast.Attribute):
        return False
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    chain = [getattr(node, "id", ""), *reversed(chain)]
    return chain[0] == "aten" or chain[:3] == ["torch", "ops", "aten"]


def _op_sets(value: ast.AST) -> bool:
    """Does the expression build a collection of ops (a literal holding one, or ``frozenset(...)`` of one)?"""
    for node in ast.walk(value):
        if isinstance(node, (ast.Set, ast.List, ast.Tuple)) and any(_is_op(e) for e in node.elts):
            return True
        if isinstance(node, (ast.SetComp, ast.ListComp, ast.GeneratorExp)) and any(map(_is_op, ast.walk(node))):
            return True
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in _COLLECTIONS
                and any(_is_op(n) for a in node.args for n in ast.walk(a))):
            return True
    return False


def _module_statements(body):
    """Module-level statements, those under a top-level ``if`` / ``try`` / ``with`` included."""
    for stmt in body:
        yield stmt
        for field in ("body", "orelse", "finalbody"):
            yield from _module_statements(getattr(stmt, field, []) if not isinstance(
                stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [])
        for handler in getattr(stmt, "handlers", []):
            yield from _module_statements(handler.body)


def offending(source: str) -> list[tuple[int, str]]:
    """(line, assigned names) of each module-level assignment in ``source`` that builds a set of ops."""
    out = []
    for stmt in _module_statements(ast.parse(source).body):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value is not None \
                and _op_sets(stmt.value):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            out.append((stmt.lineno, ", ".join(ast.unparse(t) for t in targets)))
    return out


def test_op_sets_live_in_op_classes():
    bad = []
    for pkg in PRODUCT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f == HOME:
                continue
            bad += [f"{f.relative_to(ROOT)}:{line} {names}" for line, names in offending(f.read_text())]
    assert not bad, ("module-level op sets outside fxpar/ir/op_classes.py (declare them there, named by what "
                     "the ops are, and import them):\n" + "\n".join(bad))


def test_the_lint_sees_each_form():
    src = """
import torch
aten = torch.ops.aten
A = {aten.mm, aten.bmm}
B = frozenset({torch.ops.aten.view.default})
C: tuple = ("aten::mm", "transformers::grouped_mm_fallback")
D = frozenset(TABLE) - {aten.mul}
E = [aten.t]
if True:
    F = frozenset(op for op in (aten.add, aten.sub))
TABLE = {aten.mm: (0, 1)}
ONE = aten.mm.default
NAMES = ("view", "reshape")
__all__ = ["A", "B"]
def f():
    local = {aten.mm}
"""
    assert [names for _, names in offending(src)] == ["A", "B", "C", "D", "E", "F"]
    assert offending(HOME.read_text()), "the op sets' own module declares sets this lint recognises"


def test_qualified_names_resolve_defensively_and_late():
    """A name not registered is left out (an op this torch lacks); one registered after op_classes was
    imported (a library's custom op) is found once it is."""
    from fxpar.ir.op_classes import resolve_ops

    assert resolve_ops(["aten::mm", "aten::no_such_op", "fxpar_no_such_ns::x"]) == {torch.ops.aten.mm}
    assert resolve_ops(["fxpar_test_op_sets::late"]) == frozenset()

    lib = torch.library.Library("fxpar_test_op_sets", "DEF")
    lib.define("late(Tensor x) -> Tensor")
    assert resolve_ops(["fxpar_test_op_sets::late"]) == {torch.ops.fxpar_test_op_sets.late}
