"""Compare distributed results against a single-process reference.

Everything here works on *nested outputs*: tensors inside tuples, lists, dicts,
Hugging Face ``ModelOutput`` objects (dict-like: only their non-``None`` fields
count) and dataclasses. Failures name the first mismatching leaf by path
(``outputs['logits']``, ``outputs[1][0]``), its max abs difference and where it
is, so a failing test says what differs without a debugger. Distributed leaves
are normalised first: a ``DTensor`` is gathered with ``full_tensor()`` (a
collective: every rank must compare together), and a simulated ``LocalTensor``
is compared rank by rank against the same expected value.

Tolerances default per dtype like ``torch.testing.assert_close`` (pass
``atol``/``rtol`` to override); ``NaN`` matches ``NaN``. The single-process reference runs
(:func:`reference_step`, :func:`grads_by_fqn`, trajectories) live in :mod:`fxpar.testing.reference`
and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

# Reference runs live in fxpar.testing.reference; re-exported here (tests import them from this module).
from fxpar.testing.reference import compare_trajectory as compare_trajectory
from fxpar.testing.reference import grads_by_fqn, reference_step
from fxpar.testing.reference import reference_trajectory as reference_trajectory
from fxpar.testing.reference import train_against_reference as train_against_reference

__all__ = [
    "assert_close_tree",
    "max_abs_diff_tree",
    "grads_by_fqn",
    "assert_grads_close",
    "reference_step",
    "default_tolerances",
]

_DEFAULT_TOL = {  # dtype -> (rtol, atol), as torch.testing.assert_close
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def default_tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing tensors of these dtypes: the loosest of them."""
    pairs = [_DEFAULT_TOL.get(d, (0.0, 0.0)) for d in dtypes] or [(0.0, 0.0)]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


# --------------------------------------------------------------------------
# Tree walking
# --------------------------------------------------------------------------


def _is_model_output(x: Any) -> bool:
    try:
        from transformers.utils import ModelOutput
    except Exception:
        return False
    return isinstance(x, ModelOutput)


def _children(x: Any) -> list[tuple[str, Any]] | None:
    """(path suffix, child) pairs of a container, or None for a leaf."""
    if _is_model_output(x) or isinstance(x, Mapping):
        return [(f"[{k!r}]", v) for k, v in x.items()]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return [(f".{f}", getattr(x, f)) for f in x._fields]
    if isinstance(x, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(x)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


def _kind(x: Any) -> str:
    if _is_model_output(x) or isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, (list, tuple)):
        return "sequence"
    return type(x).__name__


def _to_plain(t: torch.Tensor) -> torch.Tensor | dict[int, torch.Tensor]:
    """DTensor -> gathered tensor; LocalTensor -> {rank: tensor}; else detached."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment]
    if isinstance(t, DTensor):
        t = t.full_tensor()
    try:
        from torch.distributed._local_tensor import LocalTensor
    except Exception:  # pragma: no cover
        LocalTensor = ()  # type: ignore[assignment]
    if isinstance(t, LocalTensor):
        return {r: v.detach() for r, v in sorted(t._local_tensors.items())}
    return t.detach()


def _no_local_mode():
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

        return maybe_disable_local_tensor_mode()
    except Exception:  # pragma: no cover
        import contextlib

        return contextlib.nullcontext()


class _Mismatch:
    """One differing leaf. ``kind``: "value" (numbers differ), "shape" (tensor shape or
    dtype) or "structure" (types, keys, lengths, non-numeric leaves)."""

    __slots__ = ("path", "text", "diff", "kind")

    def __init__(self, path: str, text: str, diff: float, kind: str = "value"):
        self.path, self.text, self.diff, self.kind = path, text, diff, kind


def _tensor_mismatch(
    path: str, a: torch.Tensor, b: torch.Tensor, atol: float | None, rtol: float | None, check_dtype: bool
) -> _Mismatch | None:
    # Plain per-rank tensors: compare with any LocalTensorMode switched off, else
    # every op here would itself run once per simulated rank.
    with _no_local_mode():
        return _plain_tensor_mismatch(path, a, b, atol, rtol, check_dtype)


def _plain_tensor_mismatch(
    path: str, a: torch.Tensor, b: torch.Tensor, atol: float | None, rtol: float | None, check_dtype: bool
) -> _Mismatch | None:
    if a.shape != b.shape:
        return _Mismatch(path, f"shape {tuple(a.shape)} != expected {tuple(b.shape)}", math.inf, "shape")
    if check_dtype and a.dtype != b.dtype:
        return _Mismatch(path, f"dtype {a.dtype} != expected {b.dtype}", math.inf, "shape")
    d_rtol, d_atol = default_tolerances(a.dtype, b.dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    if a.numel() == 0:
        return None
    af, bf = a.detach().cpu(), b.detach().cpu()
    if af.is_floating_point() or bf.is_floating_point() or af.is_complex() or bf.is_complex():
        common = torch.promote_types(af.dtype, bf.dtype)
        common = torch.promote_types(common, torch.float64)
    else:
        common = torch.float64 if (af.dtype != torch.bool) else torch.bool
    if common == torch.bool:
        bad = af != bf
        diff = bad.to(torch.float64)
    else:
        af, bf = af.to(common), bf.to(common)
        close = torch.isclose(af, bf, rtol=rtol, atol=atol, equal_nan=True)
        bad = ~close
        diff = (af - bf).abs()
        both_nan = torch.isnan(af) & torch.isnan(bf) if af.is_floating_point() or af.is_complex() else None
        if both_nan is not None:
            diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    flat = int(torch.argmax(diff.reshape(-1)))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    max_diff = float(diff.reshape(-1)[flat])
    av = a.detach().reshape(-1)[flat].item()
    bv = b.detach().reshape(-1)[flat].item()
    text = (
        f"max abs diff {max_diff:.3g} at index {idx} (actual {av:.6g}, expected {bv:.6g}); "
        f"{n_bad}/{a.numel()} elements ({100.0 * n_bad / a.numel():.2g}%) outside atol={atol:g}, rtol={rtol:g}"
    )
    return _Mismatch(path, text, max_diff)


def _type_mismatch(path: str, actual: Any, expected: Any) -> _Mismatch:
    return _Mismatch(path, f"type {type(actual).__name__} != expected {type(expected).__name__}", math.inf,
                     "structure")


def _compare(
    actual: Any,
    expected: Any,
    path: str,
    atol: float | None,
    rtol: float | None,
    check_dtype: bool,
    out: list[_Mismatch],
) -> None:
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            out.append(_type_mismatch(path, actual, expected))
            return
        a, b = _to_plain(actual), _to_plain(expected)
        a_ranks = a if isinstance(a, dict) else None
        b_ranks = b if isinstance(b, dict) else None
        if a_ranks is None and b_ranks is None:
            m = _tensor_mismatch(path, a, b, atol, rtol, check_dtype)
            if m:
                out.append(m)
            return
        ranks = sorted(set(a_ranks or {}) | set(b_ranks or {}))
        for r in ranks:
            ar = a_ranks.get(r) if a_ranks is not None else a
            br = b_ranks.get(r) if b_ranks is not None else b
            p = f"{path} (rank {r})"
            if ar is None or br is None:
                out.append(_Mismatch(p, "missing on this rank", math.inf, "structure"))
                continue
            m = _tensor_mismatch(p, ar, br, atol, rtol, check_dtype)
            if m:
                out.append(m)
        return

    a_children, b_children = _children(actual), _children(expected)
    if a_children is not None or b_children is not None:
        if a_children is None or b_children is None or _kind(actual) != _kind(expected):
            out.append(_type_mismatch(path, actual, expected))
            return
        if _kind(actual) == "mapping":
            ak = [k for k, _ in a_children]
            bk = [k for k, _ in b_children]
            if set(ak) != set(bk):
                missing = [k for k in bk if k not in ak]
                extra = [k for k in ak if k not in bk]
                out.append(
                    _Mismatch(
                        path, f"keys differ: missing {missing}, unexpected {extra}", math.inf, "structure"
                    )
                )
                return
            bmap = dict(b_children)
            for k, v in a_children:
                _compare(v, bmap[k], path + k, atol, rtol, check_dtype, out)
            return
        if len(a_children) != len(b_children):
            out.append(
                _Mismatch(
                    path, f"length {len(a_children)} != expected {len(b_children)}", math.inf, "structure"
                )
            )
            return
        for (k, v), (_, w) in zip(a_children, b_children):
            _compare(v, w, path + k, atol, rtol, check_dtype, out)
        return

    # Non-tensor leaves.
    if (
        isinstance(actual, (int, float))
        and isinstance(expected, (int, float))
        and not (isinstance(actual, bool) or isinstance(expected, bool))
    ):
        a, b = float(actual), float(expected)
        r = 0.0 if rtol is None else rtol
        t = 0.0 if atol is None else atol
        if math.isnan(a) and math.isnan(b):
            return
        if not (abs(a - b) <= t + r * abs(b)):
            diff = abs(a - b) if not (math.isnan(a) or math.isnan(b)) else math.inf
            out.append(_Mismatch(path, f"{actual!r} != expected {expected!r} (abs diff {diff:.3g})", diff))
        return
    if type(actual) is not type(expected) or actual != expected:
        out.append(_Mismatch(path, f"{actual!r} != expected {expected!r}", math.inf, "structure"))


def _mismatches(actual, expected, what, atol, rtol, check_dtype) -> list[_Mismatch]:
    out: list[_Mismatch] = []
    _compare(actual, expected, what, atol, rtol, check_dtype, out)
    return out


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def assert_close_tree(
    actual: Any,
    expected: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "outputs",
    check_dtype: bool = False,
) -> None:
    """Assert two nested structures match: same structure, tensors close, other leaves equal.

    Raises ``AssertionError`` naming the first mismatching leaf path (``what`` is its
    root name), its max abs diff and index, plus how many other leaves differ.
    ``atol``/``rtol`` default per dtype; ``check_dtype`` also requires equal dtypes.
    """
    bad = _mismatches(actual, expected, what, atol, rtol, check_dtype)
    if not bad:
        return
    first = bad[0]
    msg = f"{what} differ at {first.path}: {first.text}"
    if len(bad) > 1:
        others = ", ".join(m.path for m in bad[1:6]) + (", ..." if len(bad) > 6 else "")
        msg += f"\n{len(bad) - 1} more mismatching leaves: {others}"
    raise AssertionError(msg)


def max_abs_diff_tree(a: Any, b: Any) -> float:
    """Largest absolute elementwise difference over all tensor/number leaves.

    ``inf`` if shapes differ or one side is NaN where the other is not; raises
    ``ValueError`` if the structures (keys, lengths, types) differ.
    """
    worst = 0.0
    out: list[_Mismatch] = []
    _compare(a, b, "tree", 0.0, 0.0, False, out)
    for m in out:
        if m.kind == "structure":
            raise ValueError(f"structures differ at {m.path}: {m.text}")
        worst = max(worst, m.diff)
    return worst


def assert_grads_close(
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "grads",
) -> None:
    """Assert two ``{FQN: grad}`` dicts match, naming *every* parameter that differs.

    Lists parameters missing from ``actual``, unexpected in it, without a gradient on one
    side, with a different shape, or with values outside tolerance (with the max abs diff,
    sorted worst first).
    """
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    problems: list[tuple[float, str]] = []
    n_checked = 0
    for name in expected:
        if name not in actual:
            continue
        n_checked += 1
        a, b = actual[name], expected[name]
        if a is None or b is None:
            if a is None and b is None:
                continue
            side = "actual" if a is None else "expected"
            problems.append((math.inf, f"  {name}: no gradient in {side}"))
            continue
        out: list[_Mismatch] = []
        _compare(a, b, name, atol, rtol, False, out)
        for m in out:
            problems.append((m.diff, f"  {m.path}: {m.text}"))
    if not (missing or extra or problems):
        return
    lines = [f"{what} differ from the reference:"]
    if missing:
        lines.append(f"  missing from actual ({len(missing)}): {', '.join(missing)}")
    if extra:
        lines.append(f"  unexpected in actual ({len(extra)}): {', '.join(extra)}")
    if problems:
        problems.sort(key=lambda p: -p[0] if not math.isnan(p[0]) else -math.inf)
        worst = problems[0][0]
        lines.append(
            f"  {len(problems)} of {n_checked} compared parameters differ (worst max abs diff {worst:.3g}):"
        )
        lines += [p[1] for p in problems]
    raise AssertionError("\n".join(lines))
