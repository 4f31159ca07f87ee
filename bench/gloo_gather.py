"""Gloo all-gathers three ways, side by side in one run: torch's ``all_gather_into_tensor``, torch's
``all_gather`` into the output's slices, and fxpar's one broadcast per member into the output's slices
(``fxpar.runtime.dist_calls.gather_by_broadcasts``, what fxpar's runtime sends on gloo).

    OMP_NUM_THREADS=1 python bench/gloo_gather.py [--worlds 2,4] [--mib 1,16] [--reps 5]

Per world size and shard size: the median time of ``--reps`` calls (the three ways interleaved, after one
warm-up each) and the scratch, the allocator's peak over one call beside the output made before it, per output
byte (:class:`~fxpar.runtime.memtrack.AllocatorPeak`, as ``fxpar calibrate``'s ``gather_scratch``). Every way's
output is checked against the expected gather.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _ways(out: torch.Tensor, x: torch.Tensor) -> dict:
    from fxpar.runtime import dist_calls

    w = dist.get_world_size()
    return {"all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait(),
            "all_gather (slices)": lambda: dist.all_gather(list(out.chunk(w)), x, async_op=True).wait(),
            "broadcasts (fxpar)": lambda: dist_calls.gather_by_broadcasts(out, x).wait()}


def measure(numel: int, reps: int) -> dict:
    from fxpar.runtime.memtrack import AllocatorPeak

    w, r = dist.get_world_size(), dist.get_rank()
    x = torch.full((numel,), float(r))
    out = torch.empty(w * numel)
    want = torch.cat([torch.full((numel,), float(i)) for i in range(w)])
    ways = _ways(out, x)
    res = {k: {"times": []} for k in ways}
    for name, fn in ways.items():
        fn()
        out.zero_()
        with AllocatorPeak() as mem:
            fn()
            mem.mark()
            fn()
        res[name]["equal"] = torch.equal(out, want)
        res[name]["scratch"] = max(0, mem.peak - mem.start) / out.nbytes
    for _ in range(reps):  # interleaved, so load hits every way alike
        for name, fn in ways.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            res[name]["times"].append(time.perf_counter() - t)
    return {k: {"ms": 1e3 * statistics.median(v["times"]), "scratch": v["scratch"], "equal": v["equal"]}
            for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--mib", default="1,16", help="MiB per rank's shard (fp32)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from fxpar.testing.multiproc import RankPool

    print("| ranks | MiB per shard | way | ms (median) | x broadcasts | scratch per output byte | equal |")
    print("|---|---|---|---|---|---|---|")
    for world in map(int, args.worlds.split(",")):
        with RankPool(world, timeout=600, echo_output=False) as pool:
            for mib in map(int, args.mib.split(",")):
                got = pool.run(measure, mib << 18, args.reps, timeout=600)[0]
                base = got["broadcasts (fxpar)"]["ms"]
                for name, v in got.items():
                    print(f"| {world} | {mib} | {name} | {v['ms']:.1f} | {v['ms'] / base:.2f} | {v['scratch']:.2f} "
                          f"| {v['equal']} |", flush=True)


if __name__ == "__main__":
    main()
