"""``fxpar calibrate``'s measurements that compile a model (so they live with the command, not in
:mod:`fxpar.runtime`): the pipeline runtime's bookkeeping per action (on both ranks of a world of 2), and the
cost per op of fxpar's executed program (one process)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from fxpar.ir.schedule import stages_per_rank

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "interleaved_zb")


def _agreed_loop(fn, seconds: float) -> list[float]:
    """Seconds per call of ``fn``, a call that talks to the other rank: both ranks make the same number of calls
    (a warm-up call, then as many as the slower rank's first call says fill ``seconds``, at least 3), since a
    count each rank drew from its own clock leaves one rank waiting for a message the other never sends."""
    import time

    t = time.perf_counter()
    fn()
    n = torch.tensor([max(3, min(500, int(seconds / max(time.perf_counter() - t, 1e-6))))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    times = []
    for _ in range(int(n.item())):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def pipeline_actions(*, quick: bool = False, schedules=SCHEDULES) -> dict:
    """{schedule: s per action} of the pipeline runtime: a tiny Llama (4 layers of 32, 1 x 8 tokens per microbatch:
    negligible compute) compiled with pp=2 at 2 and 8 microbatches; the step's growth per action of the rank, less
    the growth of the model's single-process forward and backward (half of it per rank and microbatch) and of one
    send and one receive per microbatch (a ping-pong measured here). The largest of the two ranks."""
    import fxpar
    from fxpar import zoo
    from fxpar.ir.schedule import build_schedule
    from fxpar.runtime.calibrate_step import rate_loop, typical

    cpu, seconds = torch.device("cpu"), 0.1 if quick else 1.0  # (0.3 s windows: a few steps, 0 to 7 ms per action)
    small = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64)
    cfg = zoo.tiny_config("llama", **small)
    model = zoo.build("llama", seed=0, **small)
    mb = zoo.example_inputs("llama", cfg, batch=1, seq=8)
    program = fxpar.trace(model, example_kwargs=mb)
    fb = typical(rate_loop(lambda: model(**mb).loss.backward(), cpu, seconds))
    buf, me = torch.ones(256), dist.get_rank()
    ping = typical(_agreed_loop(lambda: (dist.send(buf, 1), dist.recv(buf, 1)) if me == 0 else
                             (dist.recv(buf, 0), dist.send(buf, 0)), seconds)) / 2
    out = {}
    for schedule in schedules[:2] if quick else schedules:
        v = stages_per_rank(schedule, None)
        step_s, actions = {}, {}
        for m in (2, 8):
            batch = zoo.example_inputs("llama", cfg, batch=m, seq=8)
            plan = fxpar.Plan(pp=2, microbatches=m, schedule=schedule, virtual_stages=v if v > 1 else None)
            log = logging.getLogger("fxpar")
            level = log.level
            log.setLevel(logging.ERROR)  # (compile's advice that 4 tiny layers need no pipeline is not news here)
            try:
                c = fxpar.compile(model, plan, example_kwargs=batch, program=program,
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.0))
            finally:
                log.setLevel(level)
            step_s[m] = typical(_agreed_loop(functools.partial(c.step, **batch), seconds))
            actions[m] = len(build_schedule(schedule, 2, m, 2 * v)[me])
            del c
        compute = 6 * (fb / 2 + 2 * ping)  # 6 more microbatches: their compute and sends on this rank
        t = torch.tensor([max(0.0, (step_s[8] - step_s[2] - compute) / (actions[8] - actions[2]))], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[schedule] = t.item()
    return out


def step_op_overhead(profile, *, seconds: float = 1.0, at: float | None = None) -> dict:
    """The seconds per op of a training step as fxpar's runtime runs it (the program's nodes called one by one,
    autograd, the optimizer's loop), which a chain of bare ops (:func:`fxpar.runtime.calibrate.measure_op_overhead`)
    underrates several times over: a tiny Llama (4 layers of 32, 1 x 8 tokens: almost no arithmetic) compiled
    dp=1, its median step, less the price of its arithmetic on ``profile`` (no overhead), over the ops the price
    counts (one per node forward, two backward). One process; a model unlike the ones a plan is priced for, so
    that no priced plan is fitted. ``at``: the calibration's host reference seconds, at whose speed the step is
    read (:func:`fxpar.runtime.calibrate_step.host_reference`, measured around it)."""
    import dataclasses

    import fxpar
    from fxpar import zoo
    from fxpar.cost.estimate import price_plan
    from fxpar.planner.model_costs import model_costs
    from fxpar.runtime.calibrate_step import at_host_speed, rate_loop, typical

    small = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64)
    cfg = zoo.tiny_config("llama", **small)
    batch = zoo.example_inputs("llama", cfg, batch=1, seq=8)
    c = fxpar.compile(zoo.build("llama", seed=0, **small), "dp=1", example_kwargs=batch,
                      optimizer=functools.partial(torch.optim.AdamW, lr=0.0))
    c.step(**batch)  # (the first step builds what later steps reuse; rate_loop warms up once more)
    step, speed = at_host_speed(lambda: typical(rate_loop(functools.partial(c.step, **batch), torch.device("cpu"),
                                                          seconds)), [])
    step *= at / speed if at else 1.0
    costs = model_costs(zoo.build("llama", seed=0, **small), 8)
    bare = price_plan(costs, fxpar.Plan(), dataclasses.replace(profile, op_overhead=0.0), global_batch=1).step_time
    ops = (price_plan(costs, fxpar.Plan(), dataclasses.replace(profile, op_overhead=1e-6),
                      global_batch=1).step_time - bare) / 1e-6
    return {"step": step, "arithmetic": bare, "ops": ops, "op_overhead": max(0.0, step - bare) / max(ops, 1.0)}
