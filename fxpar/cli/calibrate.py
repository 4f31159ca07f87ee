"""``fxpar calibrate``: measure this machine (matmul and elementwise throughput, op overhead, ranks sharing
the host's cores, collective latency and bandwidth per group size) and write the device profile the planner
and ``fxpar plan --auto`` read (:func:`fxpar.cost.profiles.load_profile`).

One process forks ``--world`` gloo ranks on a CPU host; under torchrun (``torchrun --nproc_per_node 8 -m
fxpar calibrate``) the ranks torchrun started measure, over NCCL on CUDA, and rank 0 writes the file.
"""

from __future__ import annotations

import functools
import os

from fxpar.cost.profiles import DEFAULT_PATH, fit_alpha_beta, profile_from_measurements


def add_arguments(p) -> None:
    p.add_argument("--world", type=int, default=8, help="ranks to measure collectives on (ignored under torchrun)")
    p.add_argument("--out", default=str(DEFAULT_PATH), help="profile JSON to write (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and groups of 2 only: seconds, rough figures")
    p.add_argument("--name", default=None, help="the profile's name (default calibrated-<host>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the forked ranks may take")
    p.add_argument("--reference", action="store_true", help="also fit the matmul rate to a reference model's "
                   "measured training step (fxpar.planner.reference; off by default: see docs/planner.md)")


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def _init_torchrun():
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist


def _table(m: dict, profile) -> str:
    g = 1e9
    rows = [f"device profile {profile.name}: {profile.source}",
            f"  measured in {m['seconds']:.1f} s on {m['world']} ranks ({m['backend']}), {m['cores']} cores"]
    if m.get("host_speed"):
        h = m["host_speed"]
        rows.append(f"  host speed  reference step {h['reference_s'] * 1e3:.1f} ms (median of {len(h['samples'])}, "
                    f"{h['spread']:.2f}x from fastest to slowest): the one-process figures below are read at it")
    for key, r in m["matmul"].items():
        sizes = ", ".join(f"{n}: {v / g:.0f}" for n, v in r["by_size"].items())
        rows.append(f"  matmul {key:5s} {r['flops'] / g:9.1f} GFLOP/s   (by size {sizes})")
    bw = m["memory_bandwidth"]
    sizes = ", ".join(f"{mb} MB: {v / g:.1f}" for mb, v in bw["by_size"].items())
    rows.append(f"  memory      {bw['bytes_per_s'] / g:9.1f} GB/s      (add, by size {sizes})")
    o = m["op_overhead"]
    rows.append(f"  op overhead {o['forward'] * 1e6:9.2f} us/op fwd, {o['backward'] * 1e6:.2f} us/op bwd")
    if m.get("compute_share"):
        rows.append("  compute share (k busy ranks -> each one's rate): "
                    + ", ".join(f"{k}: {float(v):.2f}" for k, v in m["compute_share"].items()))
    rows.append(f"  {'collective':15s} {'ranks':>5s} {'alpha us':>9s} {'beta GB/s':>10s} {'worst fit err':>13s}")
    for kind, table in profile.collectives.items():
        for n, (a, b) in sorted(table.items()):
            pts = m["times"][kind][str(n)] if str(n) in m["times"][kind] else m["times"][kind][n]
            err = max(abs(a + b * x - t) / t for x, t in pts)
            rows.append(f"  {kind:15s} {n:5d} {a * 1e6:9.1f} {1 / max(b, 1e-15) / g:10.2f} {err:12.0%}")
    for n, pts in m.get("concurrent", {}).items():
        a, b = fit_alpha_beta([tuple(p) for p in pts])
        ia, ib = profile.collectives["all_reduce"][int(n)]
        rows.append(f"  all_reduce, every rank in a group of {n} at once: alpha {a * 1e6:.1f} us, beta "
                    f"{1 / max(b, 1e-15) / g:.2f} GB/s ({b / max(ib, 1e-18):.1f}x one group's beta)")
    for kind, (a, b) in profile.collective_call.items():
        rows.append(f"  fxpar {kind} op beyond the raw collective: {a * 1e6:.1f} us per call, "
                    f"{b * 1e12:.0f} ps per byte")
    if profile.pipeline_action:
        rows.append("  pipeline runtime per action (us): " + ", ".join(f"{k}: {v * 1e6:.0f}"
                                                                      for k, v in profile.pipeline_action.items()))
    (bf, bbw), (gf, gbw), (ot, og) = profile.bucket_copy, profile.gather_copy, profile.optimizer_tensor
    rows.append(f"  DP bucket {bf * 1e6:.1f} us + copies {bbw / g:.2f} GB/s; ZeRO-3 gather {gf * 1e6:.1f} us + "
                f"{gbw / g:.2f} GB/s; optimizer {ot * 1e6:.1f} us per tensor, {og * 1e6:.1f} us per group")
    if profile.comm_share:
        rows.append("  comm share (k busy ranks -> a collective's speed): "
                    + ", ".join(f"{k}: {v:.2f}" for k, v in profile.comm_share.items()))
    rows.append(f"  links: intra {profile.intra.bandwidth / g:.2f} GB/s, {profile.intra.latency * 1e6:.1f} us/step; "
                f"memory per rank {profile.memory / 2**30:.1f} GiB, {profile.ranks_per_node} ranks per node")
    return "\n".join(rows)


def cmd_calibrate(args) -> int:
    import torch

    from fxpar.cli.calibrate_pipeline import pipeline_actions
    from fxpar.runtime.calibrate import calibrate
    from fxpar.runtime.calibrate_runtime import runtime_measurements

    torch.set_num_threads(1)  # a rank computes on one core (the forked ranks do the same)
    rank = 0
    if _under_torchrun():
        dist = _init_torchrun()
        rank = dist.get_rank()
    try:
        m = calibrate(args.world, quick=args.quick, timeout=args.timeout,
                      runtime=functools.partial(runtime_measurements, pipeline=pipeline_actions))
    finally:
        if _under_torchrun():
            dist.destroy_process_group()
    if rank != 0:
        return 0
    profile = profile_from_measurements(m, name=args.name)
    if not args.quick and not str(m.get("device", "cpu")).startswith("cuda"):
        # the op overhead as fxpar's runtime pays it, from a tiny model's step (a chain of bare ops: 3-4 us here,
        # fxpar's step: about 15)
        import dataclasses

        from fxpar.cli.calibrate_pipeline import step_op_overhead

        m["step_op_overhead"] = probe = step_op_overhead(profile, at=m.get("host_speed", {}).get("reference_s"))
        profile = dataclasses.replace(profile, op_overhead=probe["op_overhead"])
    print(_table(m, profile))
    if "step_op_overhead" in m:
        p = m["step_op_overhead"]
        print(f"  op overhead in fxpar's step: {p['op_overhead'] * 1e6:.2f} us/op "
              f"(a tiny Llama's step {p['step'] * 1e3:.2f} ms, "
              f"{p['arithmetic'] * 1e3:.2f} ms of it arithmetic, {p['ops']:.0f} ops): the profile's op overhead")
    if args.reference and not str(m.get("device", "cpu")).startswith("cuda"):
        from fxpar.planner.reference import fit_to_reference

        profile, fit = fit_to_reference(profile)
        m["reference"] = fit
        got, pred = fit["measured"], fit["predicted"]
        print(f"  reference step (Llama-shaped, hidden {fit['model']['hidden_size']}, "
              f"{fit['model']['num_hidden_layers']} "
              f"layers, vocab {fit['model']['vocab_size']}, {fit['model']['batch']} x {fit['model']['seq']} tokens): "
              f"{got['step'] * 1e3:.0f} ms, of it {got['matmul'] * 1e3:.0f} ms in matrix products; predicted "
              f"{pred['matmul'] * 1e3:.0f} (matmul) + {pred['elementwise'] * 1e3:.0f} (elementwise) + "
              f"{(pred['fresh_matmul'] + pred['fresh_elementwise']) * 1e3:.0f} (first touch) + "
              f"{pred['overhead'] * 1e3:.0f} ms (overhead)"
              f" -> matmul rate x{fit['matmul_factor']:.2f} (the rest would need x{fit['elementwise_factor']:.2f}: "
              "reported, not applied)")
    path = profile.save(args.out, extra={"measurements": m})
    print(f"wrote {path}")
    return 0
