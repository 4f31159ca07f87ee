"""``Plan(compile=True)`` on the 3-D plan (dp=2, pp=2, tp=2 with sequence parallel, ZeRO-3), 8 gloo ranks.

Eight ranks compile their stages at once on a 2-core box, so this is one case on the tiniest llama
(2 layers: one per pipeline stage), marked slow. Every rank compares its compiled run with the eager one
(3 steps, losses and every gradient of the full model).
"""

from __future__ import annotations

import pytest

from fxpar.testing import multiproc
from fxpar.testing.compiled import compiled_vs_eager

pool8 = multiproc.rank_pool_fixture(8)
TOL = 1e-5


@pytest.mark.slow
def test_3d_plan_compiled_matches_eager(pool8):
    plan = "dp=2,pp=2,tp=2,zero=3,sequence_parallel=true,microbatches=2"
    results = pool8.run(compiled_vs_eager, plan, 3, batch=4, timeout=600)
    for r in results:
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        # forward and backward of the rank's stage compiled, nothing left opaque, ZeRO-3 gathers in it
        assert r["codes"] == 2 and r["fxpar_calls"] == 0 and r["ir_param_gathers"] >= 2, r
        assert sum(r["overlapped"]) >= 1, r
    assert len({tuple(r["losses"]) for r in results}) == 1  # the batch's loss, on every rank
