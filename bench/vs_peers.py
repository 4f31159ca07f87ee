"""fxpar against every peer in one run: same model, batch, ranks and AdamW, steps interleaved.

    python bench/vs_peers.py [--steps 8] [--warmup 2] [--pairs REGEX] [--tiny] [--json FILE]
                             [--write docs/benchmarks.md]

Model: ``memory_vs_peers.CONFIG``, the 168M-parameter Llama (``--tiny``: a small Llama of the same shape
family, for smoke tests), saved once with ``save_pretrained`` into a temporary directory; the ep pair uses a
small Mixtral (:data:`MOE`), saved beside it. Global batch ``memory_vs_peers.BATCH`` x ``SEQ`` (4 x 128),
AdamW, fp32, gloo; each pair runs in its own fresh processes (world 2, or 4 for tp x fsdp), fxpar and its
peer in the same processes:

* fxpar: ``fxpar.compile(meta_model, plan, weights=dir)`` (``memory_vs_peers._fxpar``);
* torch DDP (``from_pretrained``, ``DistributedDataParallel``), FSDP2 and DTensor ``parallelize_module``
  (``memory_vs_peers._fsdp2`` / ``_dtensor``), torch.distributed.pipelining
  (``pipeline_vs_torch.TorchRunner`` on the loaded model: even split, same schedule), and transformers'
  ``from_pretrained(dir, distributed_config=DistributedConfig(...))`` (``memory_vs_peers._transformers``).

Per pair, on rank 0 (the largest rank for memory):

* set-up s: fxpar's meta model + compile (trace, passes, weight load) against the peer's ``from_pretrained``
  (or model build) + wrapping + optimizer, each between barriers;
* peak memory: the allocator's live peak over a step (``memory_vs_peers.steady_peak``: a warm-up step, then
  the measured one) above the live tensor bytes before that runner's set-up (fxpar is set up and measured
  first, then the peer: what fxpar holds is in both baselines);
* step time: after ``--warmup`` steps of each, ``--steps`` steps of each, alternating which goes first, each
  between barriers (``fxpar.testing.timing.timed``); the median per runner and fxpar / peer;
* first losses: both runners' first-step loss of the global batch (the peer's averaged over ranks) and
  their difference (the same weights from the same directory: it should be float noise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time

import memory_vs_peers as mvp  # bench/ (the script's folder is on sys.path)
import torch
import torch.distributed as dist
import transformers
from _docs import replace_section

SECTION = "### fxpar against every peer, same run (168M Llama)"
# small enough for a smoke test of every pair in minutes on 2 shared cores
TINY = dict(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
TINY_SEQ = 32
MOE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
           attention_dropout=0.0, max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
# (pair name, world, fxpar plan, peer)
PAIRS = [
    ("dp=2 vs torch DDP", 2, "dp=2", "ddp"),
    ("dp=2,zero=3 vs FSDP2", 2, "dp=2,zero=3", "fsdp2"),
    ("tp=2 vs DTensor parallelize_module", 2, "tp=2", "dtensor"),
    ("pp=2 vs torch pipelining 1F1B", 2, "pp=2,microbatches=4,schedule=1f1b", "pipelining"),
    ("tp=2 vs HF DistributedConfig(tp_size=2)", 2, "tp=2", "hf-tp"),
    ("dp=2,zero=3 vs HF DistributedConfig(fsdp_size=2)", 2, "dp=2,zero=3", "hf-fsdp"),
    ("dp=2,tp=2,zero=3 vs HF DistributedConfig(tp_size=2, fsdp_size=2)", 4, "dp=2,tp=2,zero=3", "hf-tp-fsdp"),
    ("ep=2 vs HF DistributedConfig(fsdp_size=2, ep_size=2) (Mixtral MoE)", 2, "ep=2", "hf-ep"),
]


# ---- runners: each builds on this rank and returns a step function giving the global batch's loss -------
def _ddp(path: str):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(transformers.AutoModelForCausalLM.from_pretrained(path).train())
    return mvp._eager_step(model, mvp._rows(dist.get_rank(), dist.get_world_size()), mvp._adamw(model.parameters()))


def _pipelining(path: str):
    from pipeline_vs_torch import TorchRunner

    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    return TorchRunner("1f1b", mvp._batch(), 4, model=model).step


def _hf_ep(path: str, ep: int):
    from transformers import DistributedConfig

    for k, v in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(k, str(v))
    # transformers carves ep out of fsdp x tp (ep_size must divide fsdp_size * tp_size), fxpar out of data
    # parallelism: with fsdp_size=ep_size both give each ep rank its slice of the batch
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=ep, ep_size=ep)).train()
    return mvp._eager_step(model, mvp._rows(dist.get_rank(), ep), mvp._adamw(model.parameters()))


def _fxpar_moe(path: str, plan: str):
    """fxpar's ep plan on the loaded model: ``Plan(ep=...)`` cuts its expert slices from a materialised model
    (it refuses ``weights=``), so its set-up holds a ``from_pretrained`` as the peer's does."""
    import fxpar

    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    compiled = fxpar.compile(model, plan, example_kwargs=mvp._batch(), optimizer=mvp._adamw, timeout=600)
    batch = mvp._batch()

    def step():
        loss = compiled.step(**batch).item()
        compiled.optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def _peer(kind: str, path: str):
    return {"ddp": lambda: _ddp(path), "fsdp2": lambda: mvp._fsdp2(path), "dtensor": lambda: mvp._dtensor(path, 2),
            "pipelining": lambda: _pipelining(path), "hf-tp": lambda: mvp._transformers(path, 2, 1),
            "hf-fsdp": lambda: mvp._transformers(path, 1, 2), "hf-tp-fsdp": lambda: mvp._transformers(path, 2, 2),
            "hf-ep": lambda: _hf_ep(path, 2)}[kind]()


def _global(step):
    """``step`` whose loss is averaged over the ranks (each data replica's mean: equal token counts)."""
    def inner():
        loss = torch.tensor(step())
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item()
    return inner


def _set_up(build) -> tuple:
    """(step, set-up seconds, live bytes before) of ``build()``, timed between barriers."""
    base = mvp._live()
    dist.barrier()
    t = time.perf_counter()
    step = build()
    dist.barrier()
    return step, time.perf_counter() - t, base


def run_pair(plan: str, peer: str, paths: dict, config: dict, seq: int, steps: int, warmup: int) -> dict:
    """On every rank of one pair's pool: set up fxpar, measure its memory, set up the peer, measure its memory,
    then time interleaved steps. Returns this rank's figures."""
    from fxpar.testing.timing import timed

    torch.set_num_threads(1)
    mvp.CONFIG, mvp.SEQ = config, seq  # the runners of memory_vs_peers read these
    moe = peer == "hf-ep"
    if moe:
        mvp.CONFIG = MOE
    path = paths["moe" if moe else "llama"]
    out: dict = {}
    runners = {}
    for side, build in (("fxpar", lambda: (_fxpar_moe if moe else mvp._fxpar)(path, plan)),
                        ("peer", lambda: _global(_peer(peer, path)))):
        step, setup_s, base = _set_up(build)
        losses: list[float] = []

        def recorded(step=step, losses=losses):
            losses.append(step())
            return losses[-1]
        out[side] = {"setup_s": setup_s, "peak": mvp.steady_peak(recorded).peak - base, "losses": losses}
        runners[side] = recorded
    order = list(runners)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(warmup + steps):
        for side in (order if i % 2 == 0 else order[::-1]):
            dt, _ = timed(runners[side])
            if i >= warmup:
                times[side].append(dt)
    for side in runners:
        out[side]["times"] = times[side]
    return out


# ---- reporting -------------------------------------------------------------------------------------------
def summarize(ranks: list[dict]) -> dict:
    r0 = ranks[0]
    med = {s: statistics.median(r0[s]["times"]) for s in ("fxpar", "peer")}
    peak = {s: max(r[s]["peak"] for r in ranks) for s in ("fxpar", "peer")}
    setup = {s: r0[s]["setup_s"] for s in ("fxpar", "peer")}
    first = {s: r0[s]["losses"][0] for s in ("fxpar", "peer")}
    return {"step_ms": {s: v * 1e3 for s, v in med.items()}, "step_ratio": med["fxpar"] / med["peer"],
            "peak_mib": {s: v / 2**20 for s, v in peak.items()}, "peak_ratio": peak["fxpar"] / peak["peer"],
            "setup_s": setup, "setup_ratio": setup["fxpar"] / setup["peer"], "first_loss": first,
            "loss_diff": abs(first["fxpar"] - first["peer"]),
            "losses": {s: r0[s]["losses"] for s in ("fxpar", "peer")}}


def markdown(results: dict, args, load: tuple[float, float], command: str) -> str:
    model = ("a small Llama (`--tiny`: hidden 128, 4 layers, vocabulary 2048, seq 32; its numbers mean nothing)"
             if args.tiny else "the 168M-parameter Llama of `bench/memory_vs_peers.py` (hidden 1024, 8 layers, "
             "vocabulary 32000, fp32)")
    lines = [SECTION, "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
             f"{os.cpu_count()} cores ({platform.node()}), torch {torch.__version__}, transformers "
             f"{transformers.__version__}, `FXPAR_PROGRAM_CACHE={os.environ.get('FXPAR_PROGRAM_CACHE', 'off')}`; "
             f"1-minute load average {load[0]:.1f} before, {load[1]:.1f} after; "
             f"`{command}`. {model[0].upper() + model[1:]}, the ep pair a small Mixtral (4 experts, top 2, "
             f"hidden 128, 4 layers), global batch {mvp.BATCH} x {TINY_SEQ if args.tiny else mvp.SEQ}, AdamW, "
             f"gloo, each pair in its own fresh processes with fxpar and the peer in the same ones. Step: median "
             f"of {args.steps} steps of each after {args.warmup} warm-up, interleaved, barrier to barrier on rank 0. "
             "Peak: the allocator's live peak over a step above the live bytes before the runner's set-up, the "
             "largest rank. Set-up: fxpar's meta model + compile with `weights=` the saved directory (trace, "
             "passes, load) against the peer's `from_pretrained` + wrapping + optimizer. Loss: the first step's "
             "global-batch loss, fxpar against the peer.", "",
             "| fxpar plan vs peer | ranks | step ms fxpar / peer | step x | peak MiB fxpar / peer | peak x "
             "| set-up s fxpar / peer | set-up x | first loss fxpar / peer | \\|dloss\\| |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows_at = len(lines)
    for name, world, _, _ in PAIRS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | {world} | did not run: {r['error']} | | | | | | | |")
            continue
        s, p, u, f = r["step_ms"], r["peak_mib"], r["setup_s"], r["first_loss"]
        lines.append(f"| {name} | {world} | {s['fxpar']:.0f} / {s['peer']:.0f} | {r['step_ratio']:.3f} | "
                     f"{p['fxpar']:.1f} / {p['peer']:.1f} | {r['peak_ratio']:.2f} | {u['fxpar']:.1f} / "
                     f"{u['peer']:.1f} | {r['setup_ratio']:.2f} | {f['fxpar']:.6f} / {f['peer']:.6f} | "
                     f"{r['loss_diff']:.1e} |")
    if len(lines) > rows_at:
        lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """Pairs as matched: DDP, FSDP2 and the data-parallel transformers runs train each rank on its rows of the
global batch, tensor parallelism every rank on all of it; torch pipelining runs 1F1B with 4 microbatches on an
even split of the layers (`pipeline_vs_torch.TorchRunner`), fxpar the same schedule on its own cut. Expert
parallelism: fxpar's `ep=2` is carved out of data parallelism and keeps the dense weights whole on each rank;
transformers carves `ep_size` out of `fsdp_size * tp_size`, so its closest match is `fsdp_size=2, ep_size=2`,
which also shards the dense weights (fxpar's ep does not compose with `zero=3`, hence its larger peak). fxpar's
ep plan refuses `weights=` (it cuts the expert slices from a materialised model), so its set-up there is
`from_pretrained` + compile. Peak counts tensor storage by its size (weights that are views of the
memory-mapped safetensors file included), not resident pages: `bench/memory_vs_peers.py` gives RSS."""


def _error(e: BaseException) -> str:
    """The peer's own complaint out of a rank failure: its last exception line, trimmed for a table cell."""
    text = str(e)
    found = re.findall(r"^\w[\w.]*(?:Error|Exception): .*$", text, flags=re.M)
    return (found[-1] if found else text.splitlines()[0])[:240].replace("|", "/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pairs", default="", help="regex: run the pairs whose name it matches")
    ap.add_argument("--tiny", action="store_true", help="a small Llama (smoke test)")
    ap.add_argument("--json", default=None, help="write the per-pair results here")
    ap.add_argument("--write", default=None, help="replace this benchmark's section of this markdown file")
    a = ap.parse_args()
    from fxpar.testing.multiproc import RankFailure, RankPool, set_preload

    set_preload(mvp.LIBRARIES)
    command = shlex.join(["python", "bench/vs_peers.py", *sys.argv[1:]])
    config, seq = (TINY, TINY_SEQ) if a.tiny else (mvp.CONFIG, mvp.SEQ)
    wanted = [p for p in PAIRS if re.search(a.pairs, p[0])]
    load = os.getloadavg()[0]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        paths = {"llama": os.path.join(d, "llama"), "moe": os.path.join(d, "moe")}
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config)).save_pretrained(
            paths["llama"])
        if any(p[3] == "hf-ep" for p in wanted):
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MOE)).save_pretrained(
                paths["moe"])
        for name, world, plan, peer in wanted:
            t = time.perf_counter()
            with RankPool(world, timeout=3600, pg_timeout=600, echo_output=False) as pool:
                try:
                    ranks = pool.run(run_pair, plan, peer, paths, config, seq, a.steps, a.warmup, timeout=3600)
                except RankFailure as e:
                    results[name] = {"error": _error(e)}
                    print(f"{name}: did not run: {results[name]['error']}", flush=True)
                    continue
            results[name] = r = summarize(ranks)
            print(f"{name}: step x {r['step_ratio']:.3f}, peak x {r['peak_ratio']:.2f}, set-up x "
                  f"{r['setup_ratio']:.2f}, |dloss| {r['loss_diff']:.1e} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    text = markdown(results, a, (load, os.getloadavg()[0]), command)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.write:
        replace_section(a.write, SECTION, text)
        print(f"wrote its section of {a.write}")


if __name__ == "__main__":
    main()
