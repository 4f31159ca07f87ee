"""Hand-written kernels of the emitted program, one per module, each a ``torch.library.custom_op`` with a
fake kernel, a torch path (any device) and a Triton path on GPU (issue 12). Import a kernel's module to
register its op.

Which path a kernel takes is decided here, for all of them (:func:`use_triton`): the op's ``backend``
argument where the caller gives one ("triton" / "torch"), else the one switch ``FXPAR_KERNELS_TRITON``
("1": Triton on every device, the CPU under the Triton interpreter; "0": torch's everywhere), else inside
a :func:`forced` block its choice, else ("auto") Triton on CUDA for the ops of :data:`CUDA_DEFAULT`.

The rule for :data:`CUDA_DEFAULT`: an op joins it only once ``./dev gpu`` (``bench/_gpu_checks.py``,
section "kernels") has checked its Triton path against its torch path on a GPU and measured it faster;
until then its Triton path is opt-in (``backend="triton"``, :func:`forced`, ``FXPAR_KERNELS_TRITON=1``).
``tests/e2e/test_dev_gpu_dry.py`` fails when an op of :data:`CUDA_DEFAULT` has no row in that section.
``FXPAR_KERNELS_TRITON=0`` forces every op's torch path, ZeRO-1/2's ``copy_out`` after each optimizer
step and the fused loss's included.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from fxpar.ir.options import kernels_triton

try:
    import triton
except ImportError:  # the kernels are optional: every op keeps its torch path
    triton = None

__all__ = ["CUDA_DEFAULT", "TRITON_ENV", "forced", "use_triton"]

TRITON_ENV = "FXPAR_KERNELS_TRITON"
BACKENDS = ("auto", "torch", "triton")
# The ops whose Triton path "auto" picks on CUDA: those `./dev gpu` measured faster than their torch path
# (docs/benchmarks.md, "GPU checks", an H100): pack_shard 1.28-1.33x, quantize_shard 2.6x, dequantize_copy_out
# 2.1x, the fused loss's per-chunk kernels 2.2-2.8x. copy_out's Triton path was 0.98x torch's: torch's stays.
# chunk_attention (an H200, bf16/fp16): 3.9-9.0x forward, 3.0-4.7x backward; its fp32 stays torch's by default.
CUDA_DEFAULT = frozenset({"pack_shard", "quantize_shard", "dequantize_copy_out", "linear_cross_entropy",
                          "chunk_attention"})

_FORCED: contextvars.ContextVar[str] = contextvars.ContextVar("fxpar_kernels_forced", default="auto")


@contextlib.contextmanager
def forced(backend: str):
    """Within the block, kernels whose caller says "auto" take ``backend`` ("triton": on every device,
    the CPU under ``TRITON_INTERPRET=1``; "torch"; "auto": the default rule). Tests and benchmarks use it."""
    _check(backend)
    token = _FORCED.set(backend)
    try:
        yield
    finally:
        _FORCED.reset(token)


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")


def use_triton(op: str, device: torch.device, backend: str = "auto") -> bool:
    """Whether kernel ``op`` runs its Triton path on ``device`` (see the module docstring for the order)."""
    _check(backend)
    if backend == "auto":
        env = kernels_triton()  # FXPAR_KERNELS_TRITON, read with fxpar's other options
        backend = _FORCED.get() if env is None else ("triton" if env else "torch")
    if backend == "torch":
        return False
    if backend == "triton":
        if triton is None:
            raise RuntimeError(f"the Triton path of {op} was asked for, but triton is not installed")
        return True
    return device.type == "cuda" and triton is not None and op in CUDA_DEFAULT
