"""price_plan on hand-built ModelCosts (no trace): each part of the step against the formula it follows."""

import pytest

from fxpar.cost.profiles import DeviceProfile, Link
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.planner.model_costs import ModelCosts, RankPart
from fxpar.planner.price import price_plan


def profile(rpn=8, inter=4e10, **kw):
    return DeviceProfile("test", flops={"bf16": 4e14, "fp32": 5e13}, mem_bw=2e12, memory=80 * 10**9,
                         ranks_per_node=rpn, intra=Link(3e11, 5e-6), inter=Link(inter, 2e-5),
                         peak_flops={"bf16": 1e15}, **kw)


def costs(layers=8, h=1024, seq=512, edges=True, tps=(1, 2, 4), out=True):
    """A small Llama-shaped ModelCosts: per layer 7 matmuls, attention, 6 cheap ops; TP all-reduces."""
    parts = {"pre": {}, "layer": {}, "post": {}}
    for tp in tps:
        for sp in (False, True) if tp > 1 else (False,):
            mats = [(h, h // tp)] * 4 + [(h, 4 * h // tp)] * 2 + [(4 * h // tp, h)]
            nodes = [(2 * seq * a * o, 4 * seq * a * o, 2 * seq * (a + o), 2 * a * o) for a, o in mats]
            nodes.append((2 * seq * seq * h // tp, 5 * seq * seq * h // tp, 8 * seq * h // tp, 0))
            nodes += [(4 * seq * h, 4 * seq * h, 6 * seq * h // (tp if sp else 1), 0)] * 6
            pay = 2 * seq * h
            comm = [] if tp == 1 else [("all_reduce", pay, "fwd")] * 2 + [("all_reduce", pay, "bwd")] * 2
            kept = 2 * seq * h * (6 + 12 // tp)
            act = {"none": (kept, 0), "selective": (kept // 2, kept // 2), "layer": (2 * seq * h, kept)}
            params = sum(a * o for a, o in mats) + 2 * h
            parts["layer"][(tp, sp)] = RankPart(nodes, params, comm, act, 2 * seq * h if out else 0)
            edge = [(2 * seq * h * 1000 // tp, 4 * seq * h * 1000 // tp, 2 * seq * h, 2000 * h // tp)] if edges else []
            zero = {k: (0, 0) for k in act}
            parts["pre"][(tp, sp)] = RankPart(edge, 1000 * h // tp if edges else 0, [], zero,
                                              2 * seq * h if edges else 0)
            parts["post"][(tp, sp)] = RankPart(edge, 1000 * h // tp if edges else 0, [], zero, 0)
    n = layers * parts["layer"][(1, False)].params + 2 * parts["pre"][(1, False)].params
    return ModelCosts(seq, "bf16", ["layer"] * layers, parts, n, {t: None for t in tps}, 6.0 * n, 2)


def _time(part, prof, b):
    f, bw = part.time(prof, b, "bf16")
    return f + bw


def test_one_rank_compute_is_the_parts_sum():
    c, p = costs(), profile()
    e = price_plan(c, Plan(), p, global_batch=4)
    want = sum(_time(c.part(n, 1, False), p, 4) for n in ["pre", *c.layers, "post"])
    assert e.parts["compute"] == pytest.approx(want, rel=1e-9)
    assert e.step_time == pytest.approx(want + e.parts["optimizer"], rel=1e-9)
    assert e.parts["optimizer"] == pytest.approx(28 * c.params / p.mem_bw, rel=1e-9)
    assert e.mfu == pytest.approx(c.flops_per_token * 4 * c.seq / (e.step_time * 1e15))
    assert e.tokens_per_s == pytest.approx(4 * c.seq / e.step_time)


def test_gpipe_bubble_with_equal_stages_and_no_comm():
    c, p = costs(edges=False, out=False), profile()
    for pp, m in ((2, 4), (4, 8), (8, 8)):
        e = price_plan(c, Plan(pp=pp, microbatches=m, schedule="gpipe"), p, global_batch=m)
        assert e.bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9)
        assert e.parts["bubble"] == pytest.approx(e.bubble * (e.step_time - e.parts["optimizer"]), rel=1e-9)
    with_comm = price_plan(costs(edges=False), Plan(pp=4, microbatches=8, schedule="gpipe"), p, global_batch=8)
    assert with_comm.bubble > (4 - 1) / (8 + 4 - 1) and with_comm.parts["pp_comm"] > 0


def test_zero_stages_lower_memory_in_order():
    c, p = costs(), profile()
    mem = [price_plan(c, Plan(dp=4, zero=z), p, global_batch=4).memory for z in (0, 1, 2, 3)]
    states = [m["params"] + m["grads"] + m["optimizer"] for m in mem]
    # each stage shards one more kind of state: ZeRO-3 holds only its parameter shards
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    assert mem[3]["params"] == mem[3]["grads"] == 4 * c.params // 4
    assert mem[0]["optimizer"] == 8 * c.params and mem[1]["optimizer"] == 2 * c.params
    assert [m["total"] for m in mem] == sorted((m["total"] for m in mem), reverse=True)


def test_recompute_trades_time_for_memory():
    c, p = costs(), profile()
    es = [price_plan(c, Plan(recompute=r), p, global_batch=8) for r in ("none", "selective", "layer")]
    assert es[0].step_time < es[1].step_time < es[2].step_time
    acts = [e.memory["activations"] for e in es]
    assert acts[0] > acts[1] > acts[2]


def test_tp_comm_takes_the_inter_node_link_when_the_group_spans_nodes():
    c = costs()
    inside = price_plan(c, Plan(tp=4), profile(rpn=4), global_batch=4)
    across = price_plan(c, Plan(tp=4), profile(rpn=2), global_batch=4)
    assert across.parts["tp_comm"] > 3 * inside.parts["tp_comm"] > 0
    assert inside.parts["compute"] == pytest.approx(across.parts["compute"])
    per = 4 * 8 * (2 * c.seq * 1024 * 4) * 2 * 3 / 4  # 4 all-reduces x 8 layers of b=4, 2(n-1)/n sent
    assert inside.comm_bytes["tp"] == pytest.approx(per)


def test_data_parallel_reduction_hides_behind_the_last_backward():
    c = costs()
    slow = price_plan(c, Plan(dp=4, zero=0), profile(rpn=1, inter=1e8), global_batch=4)
    fast = price_plan(c, Plan(dp=4, zero=0), profile(rpn=1, inter=1e12), global_batch=4)
    assert slow.parts["dp_comm"] > fast.parts["dp_comm"] >= 0
    assert slow.comm_bytes["dp"] == int(2 * 3 / 4 * 4 * c.params)


def test_errors_name_the_numbers():
    c, p = costs(), profile()
    with pytest.raises(PlanError, match="does not divide"):
        price_plan(c, Plan(dp=2, microbatches=3), p, global_batch=8)
    c.tp_allowed[2] = "16 heads are not divisible by 2"
    with pytest.raises(PlanError, match="heads"):
        price_plan(c, Plan(tp=2), p, global_batch=8)
    with pytest.raises(PlanError, match="pp <="):
        price_plan(c, Plan(pp=32, microbatches=32), p, global_batch=32)  # 17 cut points: 18 stages


def test_gradients_and_outputs_enter_the_peak_when_they_are_alive():
    """The loss's backward transient and the outputs kept to the step's end add to the activations; the
    gradients the step makes count only from the first backward on (not at a lone microbatch's loss,
    but through the later microbatches of gradient accumulation); DDP adds no buffer to its state. The
    optimizer step is a moment of its own: every state and gradient, and (CUDA's multi-tensor AdamW) a
    temporary of every stepped entry."""
    c, p = costs(), profile()
    post = c.part("post", 1, False)
    post.grad_bytes, post.kept_out = 3 * 2**20, 5 * 2**20
    kept = sum(c.part(n, 1, False).act["none"][0] for n in ["pre", *c.layers, "post"])
    trans = max(post.grad_bytes, max(c.part(n, 1, False).act["none"][1] for n in c.layers))
    n = c.params
    one = price_plan(c, Plan(), p, global_batch=8).memory
    assert one["activations"] == 8 * (kept + trans + post.kept_out)
    step = 16 * n + 4 * n  # params, grads, 2 states, and the step's temporaries
    assert one["total"] == max(4 * n + 8 * n + max(one["activations"], 4 * n + 8 * post.kept_out), step)
    acc = price_plan(c, Plan(microbatches=4), p, global_batch=8).memory  # 4 microbatches of 2
    assert acc["total"] == max(4 * n + 8 * n + 4 * n + 2 * (kept + trans) + 8 * post.kept_out, step)
    ddp = price_plan(c, Plan(dp=2), p, global_batch=8).memory
    assert ddp["buffers"] == 0 and ddp["activations"] == one["activations"] // 2
    assert ddp["total"] == max(16 * n + max(ddp["activations"], 4 * n + 4 * post.kept_out), step)


def test_the_optimizer_step_peaks_with_its_temporaries():
    """torch's per-tensor AdamW (the CPU's) makes two temporaries of the tensor it steps; its multi-tensor
    path (CUDA's) one of everything it steps. ZeRO-1/2 step flat shards of their gradient buckets, ZeRO-3
    of its layer buckets; each sharded over dp."""
    from fxpar.cost.memory import BUCKET, optimizer_transient

    cpu, gpu = profile(optimizer_per_tensor=True), profile()
    assert optimizer_transient(gpu, 0, 1000, 10, 1) == 4000 and optimizer_transient(gpu, 3, 1000, 10, 4) == 1000
    assert optimizer_transient(cpu, 0, 1000, 10, 1) == 80 and optimizer_transient(cpu, 3, 1000, 10, 4) == 24
    assert optimizer_transient(cpu, 2, 10**9, 10, 4) == 2 * BUCKET // 4
    c = costs()
    layer = c.part("layer", 1, False)
    per_tensor = price_plan(c, Plan(), cpu, global_batch=8).memory
    itemsize = 2 if c.dtype in ("bf16", "fp16") else 4
    largest = max(x[3] for x in c.part("pre", 1, False).nodes + layer.nodes + c.part("post", 1, False).nodes)
    multi = price_plan(c, Plan(), gpu, global_batch=8).memory
    # the same states; the step's temporaries: two of the largest tensor (fp32) against one of every entry
    assert per_tensor["params"] == multi["params"] and per_tensor["optimizer"] == multi["optimizer"]
    assert per_tensor["total"] >= 16 * c.params + 2 * 4 * largest // itemsize
    assert multi["total"] >= 20 * c.params


def test_pipeline_stages_may_start_mid_layer():
    """Like fxpar's balanced cuts (a layer's children are cut points), two stages over 8 equal layers and
    a head as slow as one layer split a layer: stage 0 holds the embedding and 4.5 layers' parameters
    (whole parts only: 4 layers, one stage with 5 layers' time, or 5 layers, 4.06 against 4)."""
    c, p = costs(), profile()
    c.part("post", 1, False).nodes = list(c.part("layer", 1, False).nodes)  # a head as slow as a layer
    e = price_plan(c, Plan(pp=2, microbatches=2, schedule="gpipe"), p, global_batch=2)
    layer, pre = c.part("layer", 1, False).params, c.part("pre", 1, False).params
    stage0 = pre + 4.5 * layer
    assert e.memory["params"] in (4 * stage0, 4 * (c.params - stage0))


def test_zero3_peaks_at_the_activations_or_a_bucket_backward():
    """ZeRO-3 drops the shards' gradients as a step begins; its peak is the later of the activations' (one
    gathered bucket beside them) and a bucket's backward (the regathered bucket, its parameters' gradients
    and their concatenation, with every other shard's gradient made), or the optimizer step."""
    c, p = costs(), profile()
    e = price_plan(c, Plan(dp=4, zero=3), p, global_batch=4).memory
    big = max(c.part(n, 1, False).params for n in ("pre", "layer", "post"))
    held = e["params"] + e["grads"] + e["optimizer"]
    assert e["buffers"] == 4 * big
    assert e["total"] == max(held - e["grads"] + e["buffers"] + e["activations"], held + 12 * big,
                             held + 4 * c.params // 4)
