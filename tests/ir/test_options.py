"""fxpar's environment variables are read in one place (fxpar.ir.options.RunOptions), documented in one
table (docs/launch.md, "Environment variables"), and a bad value is refused with a clear error."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fxpar.ir.errors import OptionError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.options import RunOptions, run_options

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for d in ("fxpar", "passes", "runtime") for p in sorted((ROOT / d).rglob("*.py"))]
OPTIONS = ROOT / "fxpar" / "ir" / "options.py"


def _names_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in PRODUCT:
        if path != OPTIONS:
            for name in set(re.findall(r"\bFXPAR_[A-Z0-9_]+", path.read_text())):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def _names_in_table() -> list[str]:
    section = (ROOT / "docs" / "launch.md").read_text().split("\n## Environment variables\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"^\| `(FXPAR_[A-Z0-9_]+)` \|", section, flags=re.M)


def test_every_variable_the_code_names_is_one_option_and_one_row_of_the_table():
    in_code, options, table = _names_in_code(), list(RunOptions.variables()), _names_in_table()
    assert sorted(set(in_code) - set(options)) == [], "FXPAR_* names in product code without a RunOptions field"
    assert sorted(set(options) - set(in_code)) == [], "RunOptions fields no product code uses"
    assert sorted(table) == sorted(options), "docs/launch.md's table and RunOptions disagree"
    assert len(set(table)) == len(table)


def _dotted(x: ast.AST) -> str:
    return f"{_dotted(x.value)}.{x.attr}" if isinstance(x, ast.Attribute) else getattr(x, "id", "")


def _reads_environ(node: ast.AST, env_constants: set[str]) -> str | None:
    """The FXPAR_* variable ``node`` reads from the environment (``os.environ.get(X)``, ``os.getenv(X)``,
    ``os.environ[X]``, ``X in os.environ``), X a literal or a name bound to one; else None."""
    def name_of(x):
        if isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value.startswith("FXPAR_"):
            return x.value
        last = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None
        return last if last in env_constants else None

    environ = ("os.environ", "environ")
    if isinstance(node, ast.Call) and node.args:
        f = _dotted(node.func)
        if f in ("os.environ.get", "environ.get", "os.getenv", "getenv"):
            return name_of(node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _dotted(node.value) in environ:
        return name_of(node.slice)
    if isinstance(node, ast.Compare) and any(_dotted(c) in environ for c in node.comparators):
        return name_of(node.left)
    return None


def test_no_product_module_but_the_options_reads_an_fxpar_variable():
    texts = {p: p.read_text() for p in PRODUCT if p != OPTIONS}
    env_constants = {m for text in texts.values() for m in re.findall(r"^(\w+) = \"FXPAR_", text, flags=re.M)}
    reads = [f"{p.relative_to(ROOT)}:{node.lineno} reads {name}" for p, text in texts.items()
             if ("environ" in text or "getenv" in text)
             for node in ast.walk(ast.parse(text)) if (name := _reads_environ(node, env_constants))]
    assert env_constants >= {"FALLBACK_ENV", "LAUNCHER_ENV"}  # (names the code binds to a variable's name)
    assert reads == [], "read it through fxpar.ir.options.run_options()"


@pytest.mark.parametrize("name, value, accepts", [
    ("FXPAR_TIMEOUT", "5min", "seconds > 0"), ("FXPAR_TIMEOUT", "0", "seconds > 0"),
    ("FXPAR_HEARTBEAT", "-1", "seconds >= 0"), ("FXPAR_MAX_PROGRAMS", "2.5", "an integer >= 1"),
    ("FXPAR_CHECK_COLLECTIVES", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("FXPAR_KERNELS_TRITON", "yes", "1 (Triton everywhere) or 0 (torch everywhere)")])
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(name, value, accepts):
    with pytest.raises(OptionError, match=re.escape(f"{name}={value!r} is not accepted: use {accepts}")) as e:
        RunOptions.from_env({name: value})
    assert (e.value.variable, e.value.value) == (name, value) and isinstance(e.value, ValueError)


def test_values_parse_to_their_types_and_unset_or_empty_is_the_default():
    got = RunOptions.from_env({"FXPAR_TIMEOUT": "20", "FXPAR_MAX_PROGRAMS": "3", "FXPAR_TRACEBACK": "Yes",
                               "FXPAR_COMPILE_FALLBACK": "0", "FXPAR_DISABLE_PASSES": "recompute, zero3,",
                               "FXPAR_DUMP_DIR": "out", "FXPAR_KERNELS_TRITON": "0", "FXPAR_HEARTBEAT": " "})
    assert (got.timeout, got.max_programs, got.traceback, got.compile_fallback) == (20.0, 3, True, False)
    assert got.disabled_passes == {"recompute", "zero3"} and got.dump_dir == Path("out")
    assert got.kernels_triton is False and got.heartbeat == 0.5 and got.profile is None
    assert RunOptions.from_env({}) == RunOptions()


def test_the_readers_see_a_variable_set_after_import(monkeypatch):
    """run_options() follows the environment (a test's monkeypatch.setenv), and each reader takes its value
    from it: the collectives' shape checks too, which read the environment once at import before."""
    import fxpar
    from fxpar.cli import failures
    from fxpar.passes.runner import PassContext
    from fxpar.runtime import collectives
    from fxpar.runtime.programs import ProgramCache

    monkeypatch.setattr(collectives, "_SHAPE_CHECKS", None)  # no set_shape_checks choice: the variable's
    for name in RunOptions.variables():
        monkeypatch.delenv(name, raising=False)
    assert run_options() == RunOptions() and not collectives._shape_checks()
    monkeypatch.setenv("FXPAR_CHECK_COLLECTIVES", "1")
    monkeypatch.setenv("FXPAR_MAX_PROGRAMS", "3")
    monkeypatch.setenv("FXPAR_DISABLE_PASSES", "zero3")
    monkeypatch.setenv("FXPAR_TRACEBACK", "1")
    plan = fxpar.Plan()
    assert collectives._shape_checks() and failures.want_traceback()
    assert ProgramCache(None, None, None).max_programs == 3 and ProgramCache(None, None, None, 5).max_programs == 5
    assert PassContext(plan, MeshSpec.for_plan(plan)).disabled == {"zero3"}
    monkeypatch.setenv("FXPAR_MAX_PROGRAMS", "many")
    with pytest.raises(OptionError, match="FXPAR_MAX_PROGRAMS='many'"):
        ProgramCache(None, None, None)


def test_a_failure_is_reported_even_with_a_bad_value_set(monkeypatch, capsys):
    """The CLI's failure report reads FXPAR_TRACEBACK: a bad value elsewhere must not make it fail in turn."""
    from fxpar.cli import failures

    for name in ("WORLD_SIZE", "FXPAR_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FXPAR_TIMEOUT", "abc")
    with pytest.raises(OptionError) as e:
        run_options()
    assert failures.user_error(f"fxpar: {e.value}", e.value) == failures.USER_ERROR
    err = capsys.readouterr().err
    assert err == "fxpar: FXPAR_TIMEOUT='abc' is not accepted: use seconds > 0 (unset or empty: 300)\n"
