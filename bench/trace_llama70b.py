"""Trace a Llama-3-70B-shaped model on the meta device, with cost metadata, and time it.

    python bench/trace_llama70b.py [--layers 80] [--seq 4096] [--write docs/benchmarks.md]

Acceptance (issue 2): under 20 s on the 2-core dev machine. The model is built on the meta device,
so no weight is allocated; the FLOP count is checked against the analytic figure.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time

import torch
import transformers

import fxpar


def llama3_70b_config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False)


def analytic_forward_flops(cfg, batch: int, seq: int) -> int:
    """2 * (matmul params) * tokens + attention (QK^T and PV: 4 * b * s^2 * hidden per layer)."""
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i  # q, o, k, v, gate, up, down
    tokens = batch * seq
    return 2 * (n * per_layer + h * v) * tokens + n * 4 * batch * seq * seq * h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--write", default=None, help="append the result to this markdown file")
    a = ap.parse_args()

    cfg = llama3_70b_config(a.layers)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    t_build = time.perf_counter() - t0
    ids = torch.zeros(a.batch, a.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    program = fxpar.trace(model, example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False})
    t_trace = time.perf_counter() - t0
    report = fxpar.inspect(program, depth=1, quiet=True)
    ops = sum(1 for n in program.nodes() if n.op == "call_function")
    params = report.total.params
    flops = report.total.flops
    want = analytic_forward_flops(cfg, a.batch, a.seq)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines = [
        f"Llama-3-70B-shaped ({a.layers} layers, hidden 8192, GQA 64/8, vocab 128256), meta device, "
        f"batch {a.batch} x seq {a.seq}",
        f"- build on meta: {t_build:.2f} s; trace + cost metadata: {t_trace:.2f} s ({ops} ops); peak RSS {rss:.0f} MB",
        f"- params {params / 1e9:.2f} B; forward FLOPs {flops:.4e} vs analytic {want:.4e} "
        f"(ratio {flops / want:.4f})",
    ]
    print("\n".join(lines))
    if a.write:
        with open(a.write, "a") as f:
            f.write(f"\n### Trace of a meta-device Llama-3-70B ({time.strftime('%Y-%m-%d')}, "
                    f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, "
                    f"transformers {transformers.__version__})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
