"""Expert parallelism priced as the runtime runs it (fxpar/cost/experts.py): the region's ops on the static
``[ep * N, H]`` buffer and fxpar's EP ops beyond their raw collectives, against hand counts off the trace."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from fxpar import zoo
from fxpar.cost.experts import COUNT_BYTES, ep_comm, ep_part
from fxpar.planner.auto import device_profile
from fxpar.planner.model_costs import model_costs

SEQ = 16


@pytest.fixture(scope="module")
def moe_part():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        costs = model_costs(zoo.build("mixtral", seed=0), SEQ, tp_degrees=(1,))
    return next(p[(1, False)] for p in costs.parts.values() if p[(1, False)].experts)


def test_region_ops_on_the_static_buffer_cost_ep_times_their_rows(moe_part):
    ex, ep = moe_part.experts, 2
    assert ex.mms and set(ex.mms) < set(ex.rows)  # the grouped matmuls, read off the graph
    got = ep_part(moe_part, ex, ep)
    for i in ex.rows:
        f, b, act, w, out = moe_part.nodes[i]
        if i in ex.mms:  # the routed rows only (the zero rows past the offsets are skipped), a zero-filled ep x output
            assert got.nodes[i] == (f, b, act + (ep - 1) * out, w / ep, ep * out)
        else:  # the activation, the gate's product: every row of the buffer
            assert got.nodes[i] == (ep * f, ep * b, ep * act, 0.0, ep * out)
    outside = [i for i in range(len(moe_part.nodes)) if i not in set(ex.rows)]
    assert all(got.nodes[i] == moe_part.nodes[i] for i in outside)
    assert any(moe_part.nodes[i][0] for i in set(ex.rows) - set(ex.mms))  # the test sees a row-wise op with FLOPs


def test_ep_ops_beyond_the_raw_collectives_are_priced_per_call(moe_part):
    ex, ep, batch = moe_part.experts, 2, 4
    base = device_profile("cpu")[0]
    calls = {"ep_counts": (3e-4, 0.0), "ep_dispatch": (1e-4, 2e-9), "ep_combine": (4e-4, 5e-10)}
    prof = dataclasses.replace(base, collective_call={**base.collective_call, **calls})
    (f0, b0, *_), (f1, b1, *_) = (ep_comm(p, moe_part, ep, batch, False, False) for p in (base, prof))
    per = ex.dispatch * batch / ex.layers  # one layer's routed rows (dispatch's input, combine's output)
    dispatch, combine = 1e-4 + 2e-9 * per, 4e-4 + 5e-10 * ex.combine * batch / ex.layers
    counts = 3e-4 + 0.0 * COUNT_BYTES
    # forward: counts, dispatch, combine per MoE layer; backward: combine's gradient (a dispatch) and dispatch's
    assert f1 - f0 == pytest.approx(ex.layers * (counts + dispatch + combine), rel=1e-9)
    assert b1 - b0 == pytest.approx(ex.layers * (dispatch + combine), rel=1e-9)


def test_cp_divides_the_rows_ep_sends(moe_part):
    """Under cp the MoE runs on the rank's S / cp tokens (passes/cp_tokens.py): the all-to-alls send 1 / cp of
    the rows, the per-expert counts' all-gather stays."""
    from fxpar.cost.context_parallel import cp_part

    p, ep, batch = device_profile("h100-80gb")[0], 2, 4
    half = cp_part(moe_part, 2)
    ex, hx = moe_part.experts, half.experts
    assert (hx.dispatch, hx.combine) == (ex.dispatch // 2, ex.combine // 2)
    counts = ex.layers * COUNT_BYTES * ex.n_experts * (ep - 1)
    sent, sent_cp = (ep_comm(p, x, ep, batch, False, False)[3] for x in (moe_part, half))
    assert sent_cp - counts == pytest.approx((sent - counts) / 2)
