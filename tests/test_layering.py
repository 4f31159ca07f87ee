"""The import rules of docs/design.md ("Layering"), checked on the source: who may import whom.

The layer table is read from docs/design.md, so the document and the check cannot disagree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
# where each shipped package's source stands (passes/ and runtime/ ship as fxpar.passes / fxpar.runtime)
SOURCES = {"fxpar": ROOT / "fxpar", "fxpar.passes": ROOT / "passes", "fxpar.runtime": ROOT / "runtime"}


def _layer_table(text: str | None = None) -> dict[str, tuple[list[str], set[str]]]:
    """layer -> (module patterns, what it may import: layer names, module names or "*"), from the
    markdown table under "## Layering" in docs/design.md."""
    text = DESIGN.read_text() if text is None else text
    section = text.split("\n## Layering\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = [re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", c)) for c in cells]
        table[names[0][0]] = (names[1], set(names[2]))
    assert table, f"no layer table under '## Layering' in {DESIGN}"
    return table


TABLE = _layer_table()


def _matches(pattern: str, name: str) -> bool:
    if pattern.endswith(".*"):
        return name == pattern[:-2] or name.startswith(pattern[:-1])
    return name == pattern


def _claims(name: str) -> list[str]:
    return [layer for layer, (patterns, _) in TABLE.items() if any(_matches(p, name) for p in patterns)]


def _layer(name: str) -> str | None:
    """The layer of module ``name``, or of the nearest enclosing module a row names (``fxpar.ir.plan.Plan``
    is ``fxpar.ir.plan``'s, ``fxpar.inspect`` the package ``fxpar``'s)."""
    while name:
        claims = _claims(name)
        if claims:
            return claims[0]
        name = name.rpartition(".")[0]
    return None


def _modules():
    """(module name, path) of every Python file fxpar ships."""
    for pkg, base in SOURCES.items():
        for f in sorted(base.rglob("*.py")):
            parts = f.relative_to(base).with_suffix("").parts
            if pkg == "fxpar" and parts[0] in ("passes", "runtime"):
                continue  # (not there today; would be a second copy of the shipped name)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((pkg, *parts)), f


def _imports(path: Path, module: str | None = None, *, type_checking: bool = True):
    """(line, imported name) for every import in the file, at module level or inside functions (and under
    ``if TYPE_CHECKING:`` unless ``type_checking`` is False); relative imports are resolved when ``module``
    (the file's own module name) is given."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = None if module is None else (module if path.name == "__init__.py" else module.rpartition(".")[0])
    skip = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                if package is None:
                    continue
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base:
                for a in node.names:  # "from fxpar.runtime import ops" imports fxpar.runtime.ops
                    yield node.lineno, f"{base}.{a.name}"


def _permitted(importer: str, target: str) -> bool:
    """May module ``importer`` import ``target`` (a module, or a name inside one)?"""
    if not (target == "fxpar" or target.startswith("fxpar.")):
        return True
    mine, theirs = _layer(importer), _layer(target)
    allowed = TABLE[mine][1]
    if theirs == mine or "*" in allowed or theirs in allowed:
        return True
    return any(target == a or target.startswith(a + ".") for a in allowed if a not in TABLE)


def test_every_module_is_in_exactly_one_layer():
    unassigned, twice = [], []
    for name, f in _modules():
        claims = _claims(name)
        if not claims:
            unassigned.append(f"{f.relative_to(ROOT)} ({name})")
        elif len(claims) > 1:
            twice.append(f"{f.relative_to(ROOT)} ({name}): {', '.join(claims)}")
    assert not unassigned and not twice, (
        "every module needs exactly one row in the layer table of docs/design.md\n"
        + "".join(f"in no layer: {m}\n" for m in unassigned) + "".join(f"in two layers: {m}\n" for m in twice))


def test_layering_rules_hold():
    bad = []
    for name, f in _modules():
        for lineno, target in _imports(f, name):
            if not _permitted(name, target):
                bad.append(f"{f.relative_to(ROOT)}:{lineno} ({_layer(name)}) imports {target} ({_layer(target)})")
    assert not bad, "layering violations (see docs/design.md, Layering):\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    """Function-level imports included (they hide a cycle from Python, not from a reader); imports under
    ``if TYPE_CHECKING:`` are not (they never run)."""
    modules = dict(_modules())
    graph = {}
    for name, f in modules.items():
        deps = set()
        for _, target in _imports(f, name, type_checking=False):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # a package importing its own submodules (to re-export or register them) is not counted;
            # a submodule importing its package is
            if target and target != name and not target.startswith(name + "."):
                deps.add(target)
        graph[name] = deps
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_package_ships():
    """pyproject's explicit ``packages`` list names every package (a missing one installs without it)."""
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    packages = {name for name, f in _modules() if f.name == "__init__.py"}
    assert packages <= set(re.findall(r'"([^"]+)"', listed)), sorted(packages - set(re.findall(r'"([^"]+)"', listed)))


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
    assert _permitted("fxpar.passes", "fxpar.ir.ops") and not _permitted("fxpar.passes", "fxpar.runtime.collectives")
    assert not _permitted("fxpar.passes", "fxpar.runtime.pipeline")


def test_table_parsing_and_claims():
    table = _layer_table("x\n## Layering\n| layer | modules | may import |\n|---|---|---|\n"
                         "| `a` | `p.a.*`, `p.b` | nothing |\n| `c` | `p.c.*` | `a`, `q.r` (not `z`) |\n## Next\n")
    assert table == {"a": (["p.a.*", "p.b"], set()), "c": (["p.c.*"], {"a", "q.r"})}
    assert _layer("fxpar.ir.plan.Plan") == "ir" and _layer("fxpar.inspect") == "api"
    assert _layer("fxpar.zoo") == "api" and _layer("fxpar.cli.train") == "cli"
    assert not _permitted("fxpar.cli", "fxpar.testing.zoo") and _permitted("fxpar.cli", "fxpar.zoo")
    assert not _permitted("fxpar.report", "fxpar.runtime.ops") and _permitted("fxpar.testing", "fxpar.cli")


def _private_reaches(path: Path, module: str):
    """(line, target) for each private name (``_x``, not dunder) this file takes from another fxpar module:
    ``from fxpar.m import _x``, or ``m._x`` on a module bound by ``import fxpar.m as m`` /
    ``from fxpar import m``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {}
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxpar") and not node.level:
            for a in node.names:
                if private(a.name):
                    yield node.lineno, f"{node.module}.{a.name}"
                else:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fxpar.") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr) \
                and node.value.id in aliases:
            yield node.lineno, f"{aliases[node.value.id]}.{node.attr}"


def test_no_private_name_across_layers():
    """A layer reaches another only through its public names (issue 26): a private helper another layer
    needs is made public where it lives, or the need goes. Inside a layer private imports stay allowed."""
    bad = []
    for name, f in _modules():
        mine = _layer(name)
        if "*" in TABLE[mine][1]:  # the test harness may reach anything
            continue
        for lineno, target in _private_reaches(f, name):
            if _layer(target) != mine:
                bad.append(f"{f.relative_to(ROOT)}:{lineno} ({mine}) reaches {target} ({_layer(target)})")
    assert not bad, "private names used across layers:\n" + "\n".join(bad)


def test_private_reach_checker(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import fxpar.runtime.collectives as C\nfrom fxpar.passes import expert_parallel as ep\n"
                 "from fxpar.cost.comm import _ring, ring\nC._copy(1)\nep._descendants\nC.copy\nep.__doc__\n")
    assert sorted(t for _, t in _private_reaches(f, "fxpar.api")) == [
        "fxpar.cost.comm._ring", "fxpar.passes.expert_parallel._descendants", "fxpar.runtime.collectives._copy"]
