"""Every GPU path fxpar has, in one run: ``./dev gpu`` on one H100 or H200 (a few minutes), ``./dev gpu --dry``
the same plumbing on the CPU with tiny shapes (CI runs it, so it cannot rot).

    ./dev gpu [--dry] [--out FILE] [--sections kernels,plans,loss,slice] [--slice-layers 4] [--seq 4096]

Sections (each runs even when an earlier one failed; the exit status is 1 if any failed):

1. **kernels**: each Triton kernel (ZeRO bucket ``pack_shard`` / ``copy_out``, int8 ``quantize_shard`` /
   ``dequantize_copy_out``, the fused loss's ``stats`` / ``grad``, context parallelism's ``chunk_attention``
   forward and backward, bf16, 2,048 causal tokens, 32 / 8 heads) compiled for the device and checked
   against its torch path on the same tensors (equal where the kernel's contract says bit-equal), then
   both timed (median of CUDA-event times; GB/s counts bytes read plus bytes written once; the buckets'
   kernels on a Llama-7B-shaped decoder layer's bucket, 202M entries).
2. **plans**: a tiny Llama compiled by fxpar on one rank of an NCCL process group (world 1: the same code
   paths as a multi-rank run, the collectives on one rank) under each plan of :data:`PLANS`, three AdamW
   steps, its losses against the eager Hugging Face module's on the same weights; which fxpar kernels ran;
   a stage that fell back to eager under ``compile=1`` is a failure.
3. **loss**: peak memory and time of the fused linear + cross-entropy against ``F.cross_entropy(h @ W.T)``
   on a Llama-3 head (vocabulary 128,256, 4,096 tokens, hidden 4,096, bf16).
4. **slice**: a Llama-3-8B-shaped slice (``--slice-layers`` decoder layers, hidden 4,096, GQA 32/8 heads,
   vocabulary 128,256, batch 1 x ``--seq``, bf16 autocast over fp32 weights, AdamW): one training step
   of the Hugging Face module eager and under ``torch.compile``, and of fxpar eager and compiled
   (``Plan(compile=True)``); median ms, MFU from the traced program's FLOPs against the device's
   published bf16 peak, peak GiB, and fxpar's predicted step time on the device's profile.

The report is a dated markdown section naming the device; on a GPU it is appended to docs/benchmarks.md
(``--out`` elsewhere); ``--dry`` writes it only where ``--out`` says.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

if "--dry" in sys.argv:  # the Triton kernels run under the interpreter on CPU; read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_checks as checks  # noqa: E402
import _gpu_runs as runs  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTIONS = ("kernels", "plans", "loss", "slice")


class Report:
    """The sections' markdown, rewritten to ``out`` after each one (a run cut short keeps what it did)."""

    def __init__(self, title: str, out: Path | None, append: bool):
        self.title, self.out, self.append = title, out, append
        self.parts: list[str] = []
        self.failed: list[str] = []
        self.start = out.read_text() if (out and append and out.exists()) else ""

    def run(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"== {name} ==", flush=True)
        try:
            body, ok = fn()
        except Exception:  # one section failing does not stop the others
            body, ok = "```\n" + traceback.format_exc()[-4000:] + "```", False
        if not ok:
            self.failed.append(name)
        status = "ok" if ok else "FAILED"
        self.parts.append(f"#### {name}: {status} ({time.perf_counter() - t0:.0f} s)\n\n{body}\n")
        print(body, flush=True)
        self.write()

    def text(self) -> str:
        verdict = "every check passed" if not self.failed else f"FAILED: {', '.join(self.failed)}"
        return f"\n### {self.title}\n\n{verdict}.\n\n" + "\n".join(self.parts)

    def write(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(self.start + self.text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton under the interpreter")
    p.add_argument("--out", type=Path, default=None, help="report file (default: docs/benchmarks.md on a GPU)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--iters", type=int, default=None, help="timed runs per measurement (default 10; 1 dry)")
    p.add_argument("--slice-layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    if unknown := set(wanted) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if not args.dry and not torch.cuda.is_available():
        print("./dev gpu needs a CUDA GPU; `./dev gpu --dry` runs the same checks on the CPU (tiny shapes).")
        return 2
    env = checks.Env.make(dry=args.dry, iters=args.iters, layers=args.slice_layers, seq=args.seq)
    out = args.out if (args.out or args.dry) else DOC
    day = datetime.date.today().isoformat()
    title = f"GPU checks (`./dev gpu`{' --dry' if args.dry else ''}), {day}, {env.device_name}"
    report = Report(title, out, append=out == DOC)
    print(f"{title}: torch {torch.__version__}", flush=True)
    report.parts.append(env.describe())
    steps = {"kernels": checks.kernels, "plans": runs.plans, "loss": checks.fused_loss, "slice": runs.slice_step}
    try:
        for name in wanted:
            report.run(name, lambda n=name: steps[n](env))
    finally:
        runs.leave_group()
    print(f"\n{'every check passed' if not report.failed else 'FAILED: ' + ', '.join(report.failed)}"
          + (f"; report in {out}" if out else ""))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
