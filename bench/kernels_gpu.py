"""fxpar's hand-written kernels against their torch paths, on one GPU.

    python bench/kernels_gpu.py [--iters 20] [--warmup 3] [--dp 8] [--tokens 4096] [--vocab 32000 128256]

* ZeRO bucket copy-in / copy-out (``fxpar.runtime.kernels.buckets``): a Llama-7B-shaped decoder layer's
  parameters (202M entries) as one bucket. ``pack_shard`` fp32 -> bf16 (dp=1: the whole bucket),
  ``pack_grads`` bf16 -> fp32 with a 1/dp pre-divide in both layouts, ``copy_out`` bf16 -> bf16. GB/s
  counts bytes read plus bytes written once each.
* Block quantization (``fxpar.runtime.kernels.quant``): ``quantize_shard`` fp32 -> int8 + scales and
  ``dequantize_copy_out`` -> bf16 of the same bucket.
* Fused linear + cross-entropy (``fxpar.runtime.kernels.cross_entropy``, skipped if absent): peak memory
  and time of loss + backward against ``F.cross_entropy(h @ W.T)``, bf16, one rank.

* The emitted program: one training step (forward, backward, AdamW) of a Llama-shaped zoo model
  (``--layers``, ``--model-hidden``, batch ``--batch`` x ``--seq``, bf16 autocast) compiled by fxpar on
  one rank, eager (``Plan(compile=False)``) against Inductor (``Plan(compile=True)``), with and without
  ``fused_loss``; compile time is left out (warm-up steps).

Each kernel runs its Triton path (``backend="triton"``) and its torch path (``backend="torch"``) on the
same tensors; the table gives the median time over ``--iters`` runs (CUDA events) and the ratio. On a
machine without a GPU it says so and exits 0: the Triton interpreter on CPU proves numerics, not speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

LAYER_7B = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2


def timed(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def row(name: str, nbytes: int, fns: dict, iters: int, warmup: int) -> list[str]:
    ms = {k: timed(f, iters, warmup) for k, f in fns.items()}
    gbs = {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}
    return [name, f"{nbytes / 2**20:.0f}", f"{ms['triton']:.3f}", f"{gbs['triton']:.0f}", f"{ms['torch']:.3f}",
            f"{gbs['torch']:.0f}", f"{ms['torch'] / ms['triton']:.2f}"]


def bucket_rows(args) -> list[list[str]]:
    from fxpar.runtime.kernels.buckets import copy_out, pack_grads, pack_shard
    from fxpar.runtime.kernels.quant import dequantize_copy_out, quantize_shard

    dev = torch.device("cuda")
    masters = [torch.randn(s, device=dev) for s in LAYER_7B]
    grads = [m.to(torch.bfloat16) for m in masters]
    numel = sum(m.numel() for m in masters)
    dp, it, wu = args.dp, args.iters, args.warmup
    rows = []

    def both(f):
        return {"triton": lambda: f("triton"), "torch": lambda: f("torch")}

    rows.append(row("pack_shard fp32->bf16 (whole bucket)", numel * (4 + 2),
                    both(lambda b: pack_shard(masters, 1, 0, torch.bfloat16, b)), it, wu))
    shard = -(-numel // dp)
    rows.append(row(f"pack_shard fp32->bf16 (rank 0 of {dp})", shard * (4 + 2),
                    both(lambda b: pack_shard(masters, dp, 0, torch.bfloat16, b)), it, wu))
    for chunked in (False, True):
        rows.append(row(f"pack_grads bf16->fp32 /{dp} ({'chunked' if chunked else 'flat'})", numel * (2 + 4),
                        both(lambda b, c=chunked: pack_grads(grads, dp, torch.float32, float(dp), c, b)), it, wu))
    flat = pack_shard(masters, 1, 0, torch.bfloat16)
    outs = [torch.empty_like(g) for g in grads]
    rows.append(row("copy_out bf16->bf16", numel * (2 + 2), both(lambda b: copy_out(flat, outs, b)), it, wu))
    block = 256
    rows.append(row("quantize_shard fp32->int8 (whole bucket)", numel * (4 + 1) + numel // block * 4,
                    both(lambda b: quantize_shard(masters, 1, 0, block, b)), it, wu))
    q, s = quantize_shard(masters, 1, 0, block)
    rows.append(row("dequantize_copy_out int8->bf16", numel * (1 + 2) + s.numel() * 4,
                    both(lambda b: dequantize_copy_out(q, s, 1, block, outs, b)), it, wu))
    return rows


def cross_entropy_rows(args) -> list[list[str]] | None:
    try:
        from fxpar.runtime.kernels.cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    import torch.nn.functional as F

    dev, rows = torch.device("cuda"), []
    for vocab in args.vocab:
        h = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
        labels = torch.randint(0, vocab, (args.tokens,), device=dev)

        def fused():
            linear_cross_entropy(h, w, labels).backward()

        def unfused():
            F.cross_entropy((h @ w.T).float(), labels).backward()
        out = [f"V={vocab}, T={args.tokens}, H={args.hidden}"]
        for fn in (fused, unfused):
            fn()
            h.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            h.grad = w.grad = None
            ms = timed(fn, args.iters, args.warmup)
            h.grad = w.grad = None
            out += [f"{peak / 2**20:.0f}", f"{ms:.2f}"]
        out.append(f"{float(out[3]) / max(float(out[1]), 1e-9):.1f}x")
        rows.append(out)
    return rows


def step_rows(args) -> list[list[str]]:
    """Median step time of eager and compiled fxpar on one GPU (see the module docstring)."""
    import fxpar
    from fxpar import zoo

    cfg = zoo.tiny_config("llama", num_hidden_layers=args.layers, hidden_size=args.model_hidden,
                          intermediate_size=args.model_hidden * 8 // 3 // 64 * 64, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=args.seq)
    batch = zoo.example_inputs("llama", cfg, batch=args.batch, seq=args.seq, device="cuda")
    rows, base = [], None
    for plan in ("compile=0,mixed_precision=bf16", "compile=1,mixed_precision=bf16",
                 "compile=0,mixed_precision=bf16,fused_loss=1", "compile=1,mixed_precision=bf16,fused_loss=1"):
        model = zoo.model_class("llama", cfg)(cfg).cuda().train()
        compiled = fxpar.compile(model, plan, example_kwargs=batch, device="cuda",
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        torch.cuda.reset_peak_memory_stats()
        ms = timed(lambda c=compiled: c.step(**batch), args.iters, args.warmup)
        base = base or ms
        rows.append([plan, f"{ms:.1f}", f"{ms / base:.3f}", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"])
        del compiled, model
        torch.cuda.empty_cache()
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model-hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA GPU (the Triton interpreter on CPU checks numerics, not "
              "speed); nothing measured.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(["kernel", "MiB moved", "Triton ms", "Triton GB/s", "torch ms", "torch GB/s", "torch/Triton"],
                bucket_rows(args)))
    ce = cross_entropy_rows(args)
    if ce is None:
        print("\nfxpar.runtime.kernels.cross_entropy not found: cross-entropy skipped")
    else:
        print()
        print(table(["shape", "fused peak MiB", "fused ms", "unfused peak MiB", "unfused ms",
                     "memory unfused/fused"], ce))
    print()
    print(table(["fxpar plan, one rank", "step ms", "vs eager", "peak GiB"], step_rows(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
