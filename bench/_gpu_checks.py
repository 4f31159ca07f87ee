"""The sections of ``bench/gpu.py`` (``./dev gpu``): each takes an :class:`Env` and returns (markdown, ok)."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LAYER_7B = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2  # a Llama-7B decoder layer's parameters
TINY_BUCKET = [(300, 17), (1000,), (64, 64), (5,)]


@dataclass
class Env:
    dry: bool
    device: torch.device
    device_name: str
    iters: int
    warmup: int
    layers: int
    seq: int

    @classmethod
    def make(cls, *, dry: bool, iters: int | None, layers: int, seq: int) -> Env:
        if dry:
            return cls(True, torch.device("cpu"), "CPU (dry run: the plumbing, no speed measured)", iters or 1, 1,
                       min(layers, 2), min(seq, 32))
        return cls(False, torch.device("cuda"), torch.cuda.get_device_name(), iters or 10, 3, layers, seq)

    def describe(self) -> str:
        import transformers
        try:
            import triton
            tri = triton.__version__
        except ImportError:
            tri = "not installed"
        cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""
        return (f"torch {torch.__version__}{cuda}, Triton {tri}, transformers {transformers.__version__}; "
                f"{self.iters} timed runs after {self.warmup} warm-up per figure (median).\n")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn) -> float:
        """Median milliseconds of ``fn()``."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    @contextlib.contextmanager
    def peak(self, box: dict):
        """``box["mib"]``: the peak bytes allocated above the start, in MiB (CUDA only; None on the CPU)."""
        if self.device.type != "cuda":
            box["mib"] = None
            yield
            return
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        self.sync()
        box["mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


# ---- 1. kernels -------------------------------------------------------------------------------------

def kernels(env: Env):
    from fxpar.runtime.kernels import buckets as bk
    from fxpar.runtime.kernels import cross_entropy as ce
    from fxpar.runtime.kernels import forced, use_triton
    from fxpar.runtime.kernels import quant as qt

    dev = env.device
    g = torch.Generator(device=dev).manual_seed(0)
    masters = [torch.randn(s, device=dev, generator=g) for s in (TINY_BUCKET if env.dry else LAYER_7B)]
    grads = [m.to(torch.bfloat16) for m in masters]
    numel, dp = sum(m.numel() for m in masters), 8
    flat = bk.pack_shard(masters, 1, 0, torch.bfloat16, "torch")
    outs = {b: [torch.empty_like(x) for x in grads] for b in ("triton", "torch")}
    q, s = qt.quantize_shard(masters, 1, 0, 256, "torch")
    cases = [  # name, bytes moved, run(backend) -> comparable result, bit-equal expected
        ("pack_shard fp32->bf16, whole bucket", numel * 6, lambda b: bk.pack_shard(masters, 1, 0, torch.bfloat16, b)),
        (f"pack_shard fp32->bf16, rank 7 of {dp}", numel * 6 // dp,
         lambda b: bk.pack_shard(masters, dp, dp - 1, torch.bfloat16, b)),
        ("copy_out bf16->bf16", numel * 4, lambda b: (bk.copy_out(flat, outs[b], b), torch.cat(
            [o.view(-1) for o in outs[b]]))[1]),
        ("quantize_shard fp32->int8", numel * 5, lambda b: torch.cat(
            [x.view(-1).float() for x in qt.quantize_shard(masters, 1, 0, 256, b)])),
        ("dequantize_copy_out int8->bf16", numel * 3, lambda b: (qt.dequantize_copy_out(
            q, s, 1, 256, outs[b], b), torch.cat([o.view(-1) for o in outs[b]]))[1]),
    ]
    rows, ok = [], True
    for name, nbytes, run in cases:
        a, b = run("triton"), run("torch")
        same = torch.equal(a, b)
        # the Triton interpreter truncates where a GPU rounds to bf16 (bit-equal on the GPU only)
        near = env.dry and torch.allclose(a.float(), b.float(), rtol=2**-7, atol=0)
        ok &= same or near
        ms = {b: env.timed(lambda b=b: run(b)) for b in ("triton", "torch")}
        auto = "Triton" if use_triton(_op_of(name), dev) else "torch"
        verdict = "equal" if same else "within bf16 truncation" if near else \
            f"DIFFERENT (max diff {(a.float() - b.float()).abs().max().item():.3g})"
        rows.append([name, verdict, f"{ms['triton']:.3f}",
                     f"{nbytes / ms['triton'] / 1e6:.0f}", f"{ms['torch']:.3f}", f"{nbytes / ms['torch'] / 1e6:.0f}",
                     f"{ms['torch'] / ms['triton']:.2f}", auto])
    tokens, vocab = (64, 300) if env.dry else (4096, 128256)
    x = torch.randn(tokens, vocab, device=dev, generator=g)
    tgt = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    tgt[::7] = -1
    lse = torch.logsumexp(x, 1)
    gl, ga = torch.rand(tokens, device=dev, generator=g), torch.rand(tokens, device=dev, generator=g)
    with forced("triton") if env.dry else contextlib.nullcontext():
        for name, tri, ref in [
            ("cross-entropy stats", lambda: torch.stack(ce.stats_triton(x.clone(), tgt)),
             lambda: torch.stack(ce.stats_torch(x.clone(), tgt))),
            ("cross-entropy grad", lambda: ce.grad_triton(x.clone(), tgt, lse, gl, ga),
             lambda: ce.grad_torch(x.clone(), tgt, lse, gl, ga)),
        ]:
            a, b = tri(), ref()
            err = ((a - b).abs() / b.abs().clamp_min(1.0)).max().item()  # sums of exp reach 1e5: relative
            ok &= err <= 1e-5
            ms_t, ms_r = env.timed(tri), env.timed(ref)
            rows.append([name, f"max rel. diff {err:.1e}", f"{ms_t:.3f}", "", f"{ms_r:.3f}", "", f"{ms_r / ms_t:.2f}",
                         "Triton" if use_triton("linear_cross_entropy", dev) else "torch"])
    row, good = _chunk_attention(env, g)
    rows.append(row)
    ok &= good
    body = table(["kernel", "Triton vs torch", "Triton ms", "Triton GB/s", "torch ms", "torch GB/s", "torch/Triton",
                  "default here"], rows)
    return body + ("\n\n(dry run: the Triton interpreter; times say nothing)" if env.dry else ""), ok


def _op_of(name: str) -> str:
    return name.split()[0]


def _chunk_attention(env: Env, g: torch.Generator) -> tuple[list, bool]:
    """chunk_attention forward + backward, causal, grouped KV: Triton against the torch path, each output's
    norm-relative difference (fp32 under the interpreter: 1e-5; bf16 on a GPU, fp32 accumulation on both
    sides, rounded to bf16 differently: 2e-2, the fused loss's bound)."""
    from fxpar.runtime.kernels import chunk_attention as ca

    dev = env.device
    (b, h, hkv, s, d), dtype = ((1, 4, 2, 48, 16), torch.float32) if env.dry else \
        ((1, 32, 8, 2048, 128), torch.bfloat16)
    q, do = (torch.randn(b, h, s, d, device=dev, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, device=dev, generator=g).to(dtype) for _ in range(2))
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()

    def run(fwd, bwd):
        out, lse = fwd(q, k, v, causal, d ** -0.5, None)
        return [out, lse, *bwd(q, k, v, out, lse, do, causal, d ** -0.5, None)]
    tri = lambda: run(ca._forward_triton, ca._backward_triton)  # noqa: E731
    ref = lambda: run(ca._forward_torch, ca._backward_torch)  # noqa: E731
    err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(tri(), ref()))
    ms_t, ms_r = env.timed(tri), env.timed(ref)
    return [f"chunk_attention fwd+bwd {str(dtype)[6:]}", f"rel. diff {err:.1e}", f"{ms_t:.3f}", "", f"{ms_r:.3f}",
            "", f"{ms_r / ms_t:.2f}", "Triton" if ca._triton(q) else "torch"], err <= (1e-5 if env.dry else 2e-2)


# ---- 3. the fused loss --------------------------------------------------------------------------------

def fused_loss(env: Env):
    from fxpar.runtime.kernels import cross_entropy as ce

    tokens, hidden, vocab = (64, 16, 300) if env.dry else (4096, 4096, 128256)
    g = torch.Generator(device=env.device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=env.device, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=env.device, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=env.device, generator=g)
    y[::11] = -100
    ways = {"fused": lambda: ce.linear_cross_entropy(h, w, y),
            "unfused": lambda: F.cross_entropy((h @ w.T).float(), y)}
    res = {}
    for name, loss_fn in ways.items():
        box = {}
        loss_fn().backward()  # warm
        h.grad = w.grad = None
        with env.peak(box):
            loss = loss_fn()
            loss.backward()
        res[name] = (loss.item(), h.grad.float().clone(), w.grad.float().clone(), box["mib"])
        h.grad = w.grad = None

        def step(f=loss_fn):
            f().backward()
            h.grad = w.grad = None
        res[name] += (env.timed(step),)
    (lf, dhf, dwf, pf, tf), (lu, dhu, dwu, pu, tu) = res["fused"], res["unfused"]
    rel = max((dhf - dhu).norm() / dhu.norm(), (dwf - dwu).norm() / dwu.norm()).item()
    ok = abs(lf - lu) <= 1e-2 and rel <= 2e-2 and (pf is None or pf < pu)
    rows = [["fused (chunk " + str(ce.chunk_tokens(tokens, hidden, vocab)) + " tokens)", f"{lf:.5f}", _fmt(pf, ".0f"),
             f"{tf:.2f}"], ["unfused", f"{lu:.5f}", _fmt(pu, ".0f"), f"{tu:.2f}"]]
    body = (f"Loss + backward, bf16, {tokens} tokens, hidden {hidden}, vocabulary {vocab}; gradients' relative "
            f"difference {rel:.1e}; memory unfused / fused "
            f"{'n/a' if pf is None else f'{pu / pf:.2f}x'}, time fused / unfused {tf / tu:.2f}x.\n\n")
    return body + table(["loss", "value", "peak MiB", "ms"], rows), ok


