"""Every entry of the pass list has its before/after graph test here (``test_<pass>.py``), with its
golden printout under ``golden/``."""

from __future__ import annotations

from pathlib import Path

from fxpar import passes

HERE = Path(__file__).parent


def test_every_pass_has_a_graph_test_and_a_golden_printout():
    names = [p.name for p in passes.PROGRAM_PASSES] + [passes.SPLIT.name] + [p.name for p in passes.STAGE_PASSES]
    missing = [n for n in names if not (HERE / f"test_{n}.py").exists()
               or not any((HERE / "golden").glob(f"{n}*.txt"))]
    assert not missing, (f"passes without a before/after graph test in {HERE}: {missing} (add test_<pass>.py, "
                         "then FXPAR_UPDATE_GOLDEN=1 to write its golden printout)")
