"""``./dev gpu --dry``: every section of bench/gpu.py runs on the CPU with tiny shapes (the Triton kernels
under the interpreter, the plans on a one-rank gloo group) and passes, so the GPU command cannot rot
between the runs on a GPU; a section that fails is reported and fails the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_dry_run_passes_every_section(tmp_path):
    import _gpu_runs

    out = tmp_path / "gpu.md"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = out.read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every check passed" in report and "FAILED" not in report
    for section in ("kernels", "plans", "loss", "slice"):
        assert f"#### {section}: ok" in report
    kernels = ["pack_shard", "copy_out", "quantize_shard", "dequantize_copy_out", "cross-entropy stats",
               "cross-entropy grad", "chunk_attention"]
    assert all(f"| {k}" in report for k in kernels)
    # a kernel whose Triton path CUDA takes by default is one `./dev gpu` checks against its torch path
    from fxpar.runtime.kernels import CUDA_DEFAULT
    rows = {"linear_cross_entropy": "cross-entropy"}
    assert all(f"| {rows.get(op, op)}" in report for op in CUDA_DEFAULT), sorted(CUDA_DEFAULT)
    for plan in _gpu_runs.PLANS:
        if plan not in _gpu_runs.DRY_SKIPS:
            assert f"| `{plan or '(default)'}` |" in report, plan
    assert "equals quantize -> dequantize" in report  # the int8 gather's steps ran
    assert report.count("| fxpar, ") == 2 and "| HF module, torch.compile |" in report


def test_a_failing_section_is_reported_and_fails_the_run(tmp_path):
    import gpu

    report = gpu.Report("t", tmp_path / "r.md", append=False)
    report.run("good", lambda: ("fine", True))
    report.run("bad", lambda: 1 / 0)
    report.run("wrong", lambda: ("numbers differ", False))
    text = (tmp_path / "r.md").read_text()
    assert report.failed == ["bad", "wrong"] and "FAILED: bad, wrong." in text
    assert "#### good: ok" in text and "ZeroDivisionError" in text and "#### wrong: FAILED" in text
