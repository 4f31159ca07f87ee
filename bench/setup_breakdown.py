"""Where ``fxpar.compile`` spends its set-up time, without and with the program cache (FXPAR_PROGRAM_CACHE).

    python bench/setup_breakdown.py [--plan tp=2] [--repeats 2]

The issue's 168M Llama (hidden 1024, 8 layers, 16 heads, vocab 32000, intermediate 2816) built on the meta
device and compiled with ``weights=`` a ``save_pretrained`` directory, batch 4 x 128, AdamW, on 2 gloo ranks
(a fresh pool per run, so every run pays its first-call costs as a new job would; the pool's forkserver has
torch, transformers and fxpar imported). Runs in turn: the cache off, the cache cold (an empty directory:
traces and saves), the cache warm (the same directory: loads), ``--repeats`` times. Per run and rank, wall
seconds of: ``fxpar.compile`` as a whole, ``torch.export.export``, the cache's load and save, the trace as a
whole (``fxpar.api.trace``: capture, lowering, costs), the pass list (``passes.run``, the weight reads
included) and the weight reads (``WeightSource.load``); then the first step's loss (equal in every run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import transformers

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
BATCH, SEQ = 4, 128
PARTS = [("export", "torch.export", "export"), ("cache load", "fxpar.frontend.program_cache", "load"),
         ("cache save", "fxpar.frontend.program_cache", "save"), ("trace", "fxpar.api", "trace"),
         ("passes", "fxpar.passes", "run"), ("weights", "fxpar.weights", "WeightSource.load")]


def _batch() -> dict:
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _timed(seconds: dict, label: str, module: str, attr: str) -> None:
    """Wrap ``module.attr`` (``Class.method`` allowed) so that its calls add their wall time to ``seconds``."""
    import importlib

    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def measure(path: str, plan: str) -> dict:
    import fxpar

    seconds: dict[str, float] = {}
    for label, module, attr in PARTS:
        _timed(seconds, label, module, attr)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).train()
    start = time.perf_counter()
    compiled = fxpar.compile(model, plan, example_kwargs=_batch(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                             weights=path, timeout=600)
    seconds["compile"] = time.perf_counter() - start
    seconds["loss"] = float(compiled.step(**_batch()))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="tp=2")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from fxpar.testing.multiproc import RankPool

    with tempfile.TemporaryDirectory() as weights, tempfile.TemporaryDirectory() as cache:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).save_pretrained(weights)
        runs = [("off", "0"), ("cold", cache), ("warm", cache)]
        for r in range(args.repeats):
            for name, setting in runs:
                if name == "cold":
                    for f in os.listdir(cache):
                        os.unlink(os.path.join(cache, f))
                os.environ["FXPAR_PROGRAM_CACHE"] = setting
                with RankPool(2, timeout=900, echo_output=False) as pool:
                    ranks = pool.run(measure, weights, args.plan, timeout=900)
                cols = ["compile", *(label for label, _, _ in PARTS)]
                print(f"run {r} cache {name:4s} " + "  ".join(
                    f"{c} " + "/".join(f"{x.get(c, 0.0):.2f}" for x in ranks) for c in cols)
                    + f"  loss {ranks[0]['loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
