"""4-bit NormalFloat blocks (QLoRA's NF4, ``Plan(base_dtype="nf4")``): fxpar's own block quantization of a
frozen weight, dequantized per layer by ``fxpar_kernels.nf4_linear`` / ``nf4_embedding``
(:mod:`fxpar.ir.quant_ops`).

Reads: a weight ``w [out, in]`` (any floating dtype). Writes: ``(codes, scales)``: per row, blocks of
:data:`BLOCK` input features, each with one fp32 scale (its largest magnitude, absmax) and 4-bit codes, an
index into :data:`LEVELS` (the 16 NF4 levels of the QLoRA paper, Dettmers et al. 2023: quantiles of N(0, 1)
scaled to [-1, 1], with an exact zero), the level nearest ``w / absmax`` (ties go to the lower level).
Two codes per byte, the even entry in the high nibble: ``codes [out, blocks * block / 2]`` uint8,
``scales [out, blocks]`` fp32. A row narrower than the block is one block of its width rounded up to even;
the padding is zero. Held: 0.5 + 4 / 64 bytes per entry (block 64), 0.14x fp32. The scales are not quantized
again (the paper's double quantization would save 0.5 - 0.127 bits per entry more; not done).

The torch path runs on every device; there is no Triton kernel (the dequantize and the matmul are two
kernels on CUDA too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "LEVELS", "dequantize_nf4", "quantize_nf4"]

BLOCK = 64  # entries per scale along the input features, as QLoRA's blocks
# The NF4 codebook (the QLoRA paper's Appendix E; the values bitsandbytes uses), ascending
LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
          -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
          0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
          0.7229568362236023, 1.0)
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(LEVELS, LEVELS[1:]))


def _block(n: int, block: int) -> int:
    return min(block, n + n % 2)


def quantize_nf4(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (uint8 codes ``[out, ceil(in / block) * block / 2]``, fp32 scales
    ``[out, ceil(in / block)]``); ``block`` even."""
    if block % 2:
        raise ValueError(f"fxpar.ir.nf4: block={block} must be even (two codes per byte)")
    out, n = w.shape
    block = _block(n, block)
    xb = F.pad(w.detach().to(torch.float32), (0, -n % block)).view(out, -1, block)
    scale = xb.abs().amax(dim=-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    idx = torch.bucketize(xb / safe[..., None], torch.tensor(_MIDPOINTS, device=w.device)).to(torch.uint8)
    idx = idx.view(out, -1)
    return idx[:, 0::2].bitwise_left_shift(4).bitwise_or_(idx[:, 1::2]), scale


def dequantize_nf4(codes: torch.Tensor, scales: torch.Tensor, in_features: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in_features]`` weight the codes and scales of :func:`quantize_nf4` stand for."""
    out, nb = scales.shape
    idx = torch.stack((codes.bitwise_right_shift(4), codes.bitwise_and(15)), dim=-1).view(out, -1)
    w = torch.tensor(LEVELS, device=codes.device)[idx.long()].view(out, nb, -1).mul_(scales[..., None])
    return w.view(out, -1)[:, :in_features].to(dtype)
