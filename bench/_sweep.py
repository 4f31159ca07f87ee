"""What the per-axis registry sweeps (``tp_sweep.py``, ``cp_sweep.py``) share: the tiny model of an
architecture and its first inputs, the loop over architectures on gloo ranks spawned once, and the command
line (``--only``, ``--limit``, ``--json``, ``--load``, ``--write``) with the saved results.

An axis sweep gives its rank function (``check_arch(arch, n)``: one dict per rank with ``loss`` and
``grad`` differences, or a ``status`` of its own), the status for a failed rank (``"tp fails"``), and the
line printed per architecture; this module does the rest.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time

import torch
from _tiny_configs import VOCAB, tiny_config
from registry_sweep import SEQ, TOL, _inputs, _why


def build(arch: str, seq: int = SEQ):
    """(model in train mode, the first inputs its forward takes) as registry_sweep builds it, ``seq`` tokens
    (or the model's axial shape)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = tiny_config(arch)
    torch.manual_seed(0)
    model = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[arch]]._from_config(cfg).train()
    vocab = getattr(model.get_output_embeddings(), "out_features", None) or cfg.get_text_config().vocab_size
    seq = math.prod(getattr(cfg, "axial_pos_shape", None) or [seq])
    errors = []
    for _, kw in _inputs(cfg, min(vocab, VOCAB), seq):
        if "use_cache" in inspect.signature(model.forward).parameters:
            kw["use_cache"] = False
        try:
            torch.manual_seed(0)
            with torch.no_grad():
                model(**kw)
            return model, kw
        except (ValueError, RuntimeError) as e:
            errors.append(e)
    raise errors[0]


def four_rows(batch: dict) -> dict:
    """``build``'s 2 rows and 2 more (each row's tokens rolled by one): 4, for dp=2 x 2 microbatches."""
    return {k: torch.cat([v, v.roll(1, -1)]) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run_sweep(check, archs: list[str], n: int, limit: int, fails: str, line, save=None) -> list[dict]:
    """``check(arch, n)`` on ``n`` gloo ranks for each architecture: rank 0's dict, with the worst loss and
    gradient difference over the ranks and ``equal`` / ``differs`` where the ranks set no status of their
    own; ``timeout`` or ``fails`` (with the first failing rank's reason) where a rank does not answer."""
    from fxpar.testing import multiproc

    results = []
    with multiproc.RankPool(n, timeout=limit) as pool:  # restarted by its next run after a failure
        for i, arch in enumerate(archs):
            t0 = time.perf_counter()
            try:
                per_rank = pool.run(check, arch, n, timeout=limit)
                res = dict(per_rank[0])
                if "status" not in res:
                    worst = max(max(r["loss"], r["grad"]) for r in per_rank)
                    res.update(loss=max(r["loss"] for r in per_rank), grad=max(r["grad"] for r in per_rank),
                               status="equal" if worst <= TOL else "differs")
            except multiproc.RankTimeout:
                res = {"arch": arch, "status": "timeout", "why": f"no answer in {limit} s"}
            except multiproc.RankFailure as e:
                res = {"arch": arch, "status": fails, "why": _why(e)[:300]}
            res["s"] = round(time.perf_counter() - t0, 1)
            results.append(res)
            if save:
                save(results)
            print(f"[{i + 1}/{len(archs)}] {line(res)}", file=sys.stderr, flush=True)
    return results


def md(text: str) -> str:
    """``text`` as one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def arguments(doc: str, axis: str, section: str) -> argparse.ArgumentParser:
    """The command line every sweep takes, ``--{axis} N`` (default 2) first; the caller adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(f"--{axis}", type=int, default=2)
    ap.add_argument("--only", help="comma-separated architecture names (default: all)")
    ap.add_argument("--limit", type=int, default=120, help="seconds per architecture")
    ap.add_argument("--json", help="write the per-architecture results here (after each one)")
    ap.add_argument("--load", help="report an earlier run's --json instead of sweeping")
    ap.add_argument("--write", help=f"replace or append the '{section}' section of this file")
    return ap


def results_of(args, axis: str, script: str, sweep) -> tuple[list[dict], float, str, list[str]]:
    """(results, minutes, the command that made them, the architectures asked for): ``--load``'s, or
    ``sweep(archs, n, limit, save)``'s, saved to ``--json`` after each architecture. A load sets
    ``args.<axis>`` to the saved run's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = [a for a in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if not args.only or a in args.only.split(",")]
    n = getattr(args, axis)
    cmd = (f"OMP_NUM_THREADS=1 python bench/{script} --{axis} {n}" + (f" --only {args.only}" if args.only else "")
           + f" --limit {args.limit}")
    t0 = time.perf_counter()

    def save(results):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({axis: n, "cmd": cmd, "results": results, "minutes": (time.perf_counter() - t0) / 60},
                          f, indent=1)

    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        setattr(args, axis, saved[axis])
        return saved["results"], saved["minutes"], saved["cmd"], archs
    results = sweep(archs, n, args.limit, save)
    return results, (time.perf_counter() - t0) / 60, cmd, archs


def partial(cmd: str, results: list, archs: list) -> str:
    """The sentence a report of an interrupted full sweep ends with ('' for a whole or an --only one)."""
    if "--only" not in cmd and len(results) < len(archs):
        return f" Partial: {len(results)} of {len(archs)} architectures, the sweep was interrupted."
    return ""
