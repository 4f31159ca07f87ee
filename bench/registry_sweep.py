"""Sweep every causal-LM architecture transformers registers: torch.export and fxpar.trace against eager.

    OMP_NUM_THREADS=1 python bench/registry_sweep.py [--only a,b] [--limit 180] [--json f] [--write docs/benchmarks.md]

Each name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny from its config class's defaults by
``_tiny_configs.tiny_config`` (rules keyed on config field names, never on model names), in ``train()``
mode with every dropout 0, on batch 2 x seq 8 with labels (or, where the forward raises on them, the next
inputs of ``_inputs``). Eager forward + backward is the reference; (a) plain
``torch.export.export(model, (), kwargs, strict=False)`` must give every output tensor bitwise equal
("export-exact"; else "export inexact" or, raising, "export fails"); (b) ``fxpar.trace`` must give the
outputs and every parameter's gradient within 1e-5 ("equal"; else "differs" or "trace fails"). Each
architecture runs in a worker process under ``--limit`` seconds; a hang or a crash costs only that one.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import torch
from _tiny_configs import VOCAB, tiny_config  # bench/ is sys.path[0]

MARK = "@@RESULT "
SECTION = "## Registry sweep"
DATE = __import__("datetime").date.today().isoformat()  # the day the table is written
BATCH, SEQ, TOL = 2, 8, 1e-5

def _tensor_leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _why(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _max_diff(a, b) -> float:
    """Largest abs difference of two output trees (NaN matches NaN; inf: structure/shape/dtype/ints differ)."""
    la, lb = _tensor_leaves(a), _tensor_leaves(b)
    worst = 0.0 if len(la) == len(lb) else float("inf")
    for x, y in zip(la, lb):
        x, y = x.detach(), y.detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        if x.is_floating_point() and x.numel():
            d = (x.double() - y.double()).abs().masked_fill(x.isnan() & y.isnan(), 0.0)
            worst = max(worst, float(d.nan_to_num(float("inf")).max()))
        elif not x.is_floating_point() and not x.equal(y):
            return float("inf")
    return worst


def _inputs(cfg, vocab: int, seq: int):
    """Example inputs, in the order tried: token ids with labels; where the config has ``num_codebooks``,
    one row of ids per codebook (labels batch x seq x codebooks); ids without labels (a loss that needs more
    than text, e.g. image tokens ahead of it: the loss is then the mean square of the first output)."""
    ids = torch.randint(0, vocab - 1, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    yield "ids", {"input_ids": ids, "labels": ids.clone()}
    books = getattr(cfg, "num_codebooks", None)
    if isinstance(books, int):
        rows = torch.randint(0, vocab - 1, (BATCH, books, seq), generator=torch.Generator().manual_seed(0))
        yield "codebooks", {"input_ids": rows.flatten(0, 1), "labels": rows.transpose(1, 2).clone()}
    yield "no labels", {"input_ids": ids}


def _loss(out):
    loss = getattr(out, "loss", None)
    return loss if loss is not None else _tensor_leaves(out)[0].float().pow(2).mean()


def run_one(arch: str) -> dict:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import fxpar
    from fxpar.cost.flops import SDPA_OPS, CostModelWarning
    from fxpar.testing.compare import grads_by_fqn

    res: dict = {"arch": arch, "status": "?", "why": ""}
    try:
        stage = "config"
        cfg = tiny_config(arch)
        stage = "build"
        torch.manual_seed(0)
        # the class registered for the name (the config may be its sub-config, which no name registers)
        model = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[arch]]._from_config(cfg).train()
        vocab = getattr(model.get_output_embeddings(), "out_features", None) or cfg.get_text_config().vocab_size
        seq = math.prod(getattr(cfg, "axial_pos_shape", None) or [SEQ])  # axial positions: exactly theirs
        stage, errors = "eager", []
        for name, kw in _inputs(cfg, min(vocab, VOCAB), seq):  # the first the forward takes
            if "use_cache" in __import__("inspect").signature(model.forward).parameters:
                kw["use_cache"] = False
            torch.manual_seed(0)
            try:
                ref = model(**kw)
                break
            except (ValueError, RuntimeError) as e:
                errors.append(e)
        else:
            raise errors[0]
        if name != "ids":
            res["inputs"] = name
        _loss(ref).backward()
        ref_grads = grads_by_fqn(model)
        model.zero_grad(set_to_none=True)
    except Exception as e:
        res.update(status="build fails", why=f"{stage}: {_why(e)}")
        try:  # does the config class's own default build (on the meta device, nothing allocated)?
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch]())
        except Exception as e2:
            res["why"] += f" (the default config fails too: {_why(e2)[:80]})"
        return res
    try:
        t0 = time.perf_counter()
        ep = torch.export.export(model, (), kw, strict=False)
        torch.manual_seed(0)
        with torch.no_grad():
            got = ep.module()(**kw)
        res["export_s"] = round(time.perf_counter() - t0, 2)
        res["export_diff"] = diff = _max_diff(got, ref)
        res["export"] = "exact" if diff == 0.0 else "inexact"
    except Exception as e:
        res.update(export="fails", export_why=_why(e))
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CostModelWarning)
            program = fxpar.trace(model, example_kwargs=kw)
        res["cost_warnings"] = sorted({str(w.message)[:160] for w in caught if w.category is CostModelWarning})
        res["trace_s"] = round(time.perf_counter() - t0, 2)
        sdpa = [n for n in program.nodes() if getattr(n.target, "overloadpacket", None) in SDPA_OPS]
        res["dv_ne_dqk"] = any(n.args[2].meta["val"].shape[-1] != n.args[0].meta["val"].shape[-1] for n in sdpa)
        torch.manual_seed(0)
        out = program(**kw)
        _loss(out).backward()
        got_grads = grads_by_fqn(model)
        out_diff, missing = _max_diff(out, ref), sorted(set(ref_grads) ^ set(got_grads))
        # a parameter eager never reached (an expert no token chose) has no gradient; a program that runs
        # every expert gives it zeros, the same gradient: listed, not a difference
        zeros = [k for k in missing if k in got_grads and not got_grads[k].any()]
        if zeros:
            res["zero_grads_eager_none"] = zeros[:4]
            missing = [k for k in missing if k not in zeros]
        grad_diff = max((float((got_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads if k in got_grads),
                        default=0.0)
        res.update(fxpar_out_diff=out_diff, fxpar_grad_diff=grad_diff, fxpar="equal")
        if missing:
            res.update(fxpar="differs", fxpar_why=f"gradients only on one side: {missing[:3]}")
        elif max(out_diff, grad_diff) > TOL:
            res.update(fxpar="differs", fxpar_why=f"outputs {out_diff:.2g}, gradients {grad_diff:.2g}")
    except Exception as e:
        res.update(fxpar="trace fails", fxpar_why=_why(e),  # raised inside fxpar's cost model?
                   in_cost_model=any("fxpar/cost/" in f.filename for f in traceback.extract_tb(e.__traceback__)))
    res["status"] = {"exact": "export-exact", "inexact": "export inexact", "fails": "export fails"}[res["export"]]
    return res


def worker() -> None:
    def alarm(signum, frame):
        raise TimeoutError("time limit reached")

    signal.signal(signal.SIGALRM, alarm)
    warnings.filterwarnings("ignore")
    for line in sys.stdin:
        arch, limit = line.split()
        signal.alarm(int(limit))
        try:
            res = run_one(arch)
        except BaseException as e:  # the alarm outside run_one's own handlers
            res = {"arch": arch, "status": "timeout", "why": _why(e)}
        finally:
            signal.alarm(0)
        print(MARK + json.dumps(res), flush=True)


class Worker:
    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.done = 0

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK):]))
        self.lines.put(None)  # the process ended

    def ask(self, arch: str, limit: int) -> dict:
        self.proc.stdin.write(f"{arch} {limit}\n")
        self.proc.stdin.flush()
        self.done += 1
        try:
            res = self.lines.get(timeout=limit + 60)
        except queue.Empty:
            return {"arch": arch, "status": "timeout", "why": f"no answer in {limit + 60} s"}
        return res or {"arch": arch, "status": "crashed", "why": f"worker exited with {self.proc.wait()}"}

    def close(self):
        self.proc.kill()  # this sweep's own worker process
        self.proc.wait()


def sweep(archs: list[str], limit: int, save=None, restart_every: int = 20) -> list[dict]:
    results, w = [], None
    for i, arch in enumerate(archs):
        if w is None or w.proc.poll() is not None or w.done >= restart_every:
            w = w and w.close() or Worker()
        t0 = time.perf_counter()
        res = w.ask(arch, limit)
        res["s"] = round(time.perf_counter() - t0, 1)
        if res["status"] in ("timeout", "crashed"):
            w = w.close()
        results.append(res)
        if save:  # after every architecture, so an interrupted sweep keeps what it measured
            save(results)
        why = res.get("fxpar_why") or res.get("export_why") or res.get("why", "")
        print(f"[{i + 1}/{len(archs)}] {arch}: {res['status']}, fxpar {res.get('fxpar', '-')} ({res['s']} s) {why}",
              file=sys.stderr, flush=True)
    return w and w.close() or results


def summarise(results: list[dict]) -> tuple[str, str]:
    """The summary line, and a table of every architecture not export-exact and reproduced, with notes."""
    exact = [r for r in results if r["status"] == "export-exact"]
    ok = [r["arch"] for r in exact if r.get("fxpar") == "equal"]
    mla = [r for r in results if r.get("dv_ne_dqk")]
    equal = sum(1 for r in results if r.get("fxpar") == "equal")
    line = (f"{len(exact)} of {len(results)} export exactly; fxpar.trace reproduces {len(ok)} of {len(exact)}; "
            f"fxpar.trace equal to eager on {equal} of {len(results)}")
    rows = ["| architecture | class | torch.export | why | fxpar.trace | why / worst difference |",
            "|---|---|---|---|---|---|"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    for r in results:
        if r["arch"] in ok:
            continue
        exp = {"export-exact": "exact", "export inexact": f"inexact ({r.get('export_diff', 0):.2g})",
               "export fails": "fails"}.get(r["status"], r["status"])
        fx_why = r.get("fxpar_why") or (f"out {r['fxpar_out_diff']:.1g}, grad {r['fxpar_grad_diff']:.1g}"
                                        if "fxpar_out_diff" in r else "")
        why = _md(r.get("export_why") or r.get("why", ""))
        rows.append(f"| {r['arch']} | {names.get(r['arch'], '')} | {exp} | {why} | {r.get('fxpar', '-')} "
                    f"| {_md(fx_why)} |")
    other = ", ".join(f"{r['arch']} ({r['inputs']})" for r in results if r.get("inputs")) or "none"
    extra = (f"By status: "
             f"{', '.join(f'{v} {k}' for k, v in sorted(collections.Counter(r['status'] for r in results).items()))}. "
             f"fxpar.trace failures raised in the cost model: {sum(bool(r.get('in_cost_model')) for r in results)}; "
             f"cost-model fallback warnings in: "
             f"{', '.join(r['arch'] for r in results if r.get('cost_warnings')) or 'none'}. "
             f"Inputs other than ids with labels: {other}. "
             f"Attention with d_v != d_qk in {len(mla)} ({', '.join(r['arch'] for r in mla)}), export-exact and "
             f"reproduced by fxpar.trace: {sum(r['arch'] in ok for r in mla)}.\n\n"
             f"Export-exact and reproduced by fxpar.trace ({len(ok)}): {', '.join(ok)}.")
    return line, "\n".join(rows) + "\n\n" + extra


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def write_section(path: str, body: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\b.*?(?=^## |\Z)", re.S | re.M)  # up to the next "## "
    text, n = pattern.subn(lambda _: body.rstrip() + "\n\n", text)
    with open(path, "w") as f:
        f.write(text.rstrip() + "\n" if n else text.rstrip() + "\n\n" + body.rstrip() + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated architecture names (default: all)")
    ap.add_argument("--limit", type=int, default=180, help="seconds per architecture")
    ap.add_argument("--json", help="write the per-architecture results here")
    ap.add_argument("--load", help="report the results of an earlier run's --json instead of sweeping")
    ap.add_argument("--write", help="replace or append the '## Registry sweep' section of this markdown file")
    args = ap.parse_args()
    if args.worker:
        return worker() or 0
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = [a for a in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if not args.only or a in args.only.split(",")]
    t0 = time.perf_counter()

    def save(results):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": results, "minutes": (time.perf_counter() - t0) / 60}, f, indent=1)

    if args.load:
        with open(args.load) as f:
            results, minutes = (saved := json.load(f))["results"], saved["minutes"]
    else:
        results = sweep(archs, args.limit, save)
        minutes = (time.perf_counter() - t0) / 60
    line, table = summarise(results)
    print(table)
    print(line)
    if args.write:
        n_all, n = len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), len(results)
        partial = f" Partial: interrupted after {n} of {n_all} architectures." if n < len(archs) else ""
        cmd = "OMP_NUM_THREADS=1 python bench/registry_sweep.py" + (f" --only {args.only}" if args.only else "") \
            + f" --limit {args.limit} --write {args.write}"
        body = (f"{SECTION}\n\n### Causal-LM registry: torch.export and fxpar.trace vs eager ({DATE}, "
                f"torch {torch.__version__}, transformers {transformers.__version__})\n\n"
                f"`{cmd}` ({minutes:.0f} min, one worker process, {args.limit} s limit per architecture). "
                f"Each architecture of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is "
                f"built tiny from its config class's defaults by the field-name rules of `bench/_tiny_configs.py` "
                f"(`tiny_config`), in train mode with dropout 0, batch {BATCH} x seq {SEQ} with labels "
                f"(other inputs, listed below, where the forward takes no such pair). torch.export must "
                f"equal eager bitwise; fxpar.trace's outputs and every parameter gradient within {TOL:g}.\n\n"
                f"**{line}.**{partial}\n\n{table}\n")
        write_section(args.write, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
