"""Chunk attention with its log-sum-exp (fxpar.runtime.kernels.chunk_attention): out and the gradients
against F.scaled_dot_product_attention and its autograd on the same tensors (against plain fp32 math
where SDPA has no soft cap), lse against torch.logsumexp of the reference scores, for the masks of the
model registry (causal, sliding window, packed documents, padding, bidirectional prefix, an additive
bias) and grouped / multi-query KV; the keys split into 2 and 4 chunks, merged with merge_partials and
differentiated chunk by chunk from the merged out and lse, equal to the whole. The Triton path runs the
same checks under the Triton interpreter (this file as a script with TRITON_INTERPRET=1, which must be
set before triton decorates the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fxpar.runtime import kernels
from fxpar.runtime.kernels import chunk_attention as ca

B, S, D = 2, 24, 8  # the Triton run takes B = 1 (the interpreter's time goes by program instances)


def _masks() -> dict:
    """Masks built from positions, as the models build them: bool [.., S, S] (True = attend) or additive."""
    pos = torch.arange(S)
    causal = pos[:, None] >= pos[None, :]
    doc = torch.tensor([0] * 7 + [1] * 10 + [2] * 7)  # three packed documents (position ids restarting)
    left_pad = torch.ones(B, S, dtype=torch.bool)
    left_pad[-1, :5] = False  # the last row starts with 5 padding tokens: its first 5 queries attend to nothing
    prefix = pos < 8  # bidirectional over the first 8 tokens (prefix LM), causal after
    packed = causal & (doc[:, None] == doc[None, :])
    return {
        "causal": causal,
        "sliding_window": causal & (pos[:, None] - pos[None, :] < 6),
        "packed_documents": packed,
        "padding": (causal & left_pad[:, None, None, :]),  # [B, 1, S, S]
        "prefix": causal | (prefix[:, None] & prefix[None, :]),
        "additive": torch.where(packed, -0.1 * (pos[:, None] - pos[None, :]).float(), float("-inf")),  # ALiBi-like
        "none": None,
    }


# name -> (mask, query heads, KV heads, softcap, scale)
CASES = {
    "causal": ("causal", 4, 4, None, None),
    "sliding_window_gqa": ("sliding_window", 4, 2, None, None),
    "packed_documents_mqa": ("packed_documents", 4, 1, None, None),
    "padding_gqa": ("padding", 4, 2, None, None),
    "prefix_bidirectional": ("prefix", 4, 2, None, None),
    "additive_bias_mqa": ("additive", 4, 1, None, None),
    "no_mask_gqa": ("none", 6, 2, None, 0.2),
    "softcap_causal_gqa": ("causal", 4, 2, 2.0, 0.5),
    "softcap_additive_mqa": ("additive", 4, 1, 5.0, None),
}


def _data(name: str, seed: int = 0):
    mask_name, h, hkv, cap, scale = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q, go = torch.randn(B, h, S, D, generator=g), torch.randn(B, h, S, D, generator=g)
    k, v = torch.randn(B, hkv, S, D, generator=g), torch.randn(B, hkv, S, D, generator=g)
    return q, k, v, go, _masks()[mask_name], cap, scale


def _scores(q, k, mask, cap, scale):
    """Plain fp32 scores [B, H, S, S] (KV repeated per query head), scaled, capped, masked."""
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * (scale or D**-0.5)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if mask is None:
        return s
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask


def _reference(q, k, v, go, mask, cap, scale):
    """(out, lse, dq, dk, dv): SDPA and its autograd, or plain softmax attention with a soft cap."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = _scores(q, k, mask, cap, scale).softmax(-1) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    (out * go).sum().backward()
    lse = torch.logsumexp(_scores(q, k, mask, cap, scale).detach(), -1)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _chunked(q, k, v, go, mask, cap, scale, chunks):
    """(out, lse, dq, dk, dv) with the keys in ``chunks`` pieces: forwards merged, backwards from the merge."""
    cuts = [round(i * S / chunks) for i in range(chunks + 1)]
    pieces = [(k[:, :, a:b], v[:, :, a:b], None if mask is None else mask[..., a:b]) for a, b in zip(cuts, cuts[1:])]
    out = lse = None
    for kc, vc, mc in pieces:
        o, s = ca.chunk_attention(q, kc, vc, mc, scale=scale, softcap=cap)
        assert o.dtype == q.dtype and s.dtype == torch.float32 and s.shape == q.shape[:3]
        out, lse = (o, s) if out is None else ca.merge_partials(out, lse, o, s)
    grads = [ca.chunk_attention_backward(q, kc, vc, out, lse, go, mc, scale=scale, softcap=cap)
             for kc, vc, mc in pieces]
    dq = sum(g[0] for g in grads)
    return out, lse, dq, torch.cat([g[1] for g in grads], 2), torch.cat([g[2] for g in grads], 2)


def check(name: str, chunks: int = 1) -> None:
    """Raise if chunk attention of case ``name`` over ``chunks`` key chunks differs from the reference."""
    q, k, v, go, mask, cap, scale = _data(name)
    got = _chunked(q, k, v, go, mask, cap, scale, chunks)
    want = _reference(q, k, v, go, mask, cap, scale)
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not a.isnan().any(), f"{name}: NaN in {what}"
        # 1e-6, relative to the tensor's largest entry where that is above 1: a gradient summed over the
        # query heads of a group and over 4 key chunks differs from SDPA's by 1-2 ulp of its largest entries
        # (up to 1.4e-6 where they are near 8), the order of the sums being different
        scale = max(1.0, b[b.isfinite()].abs().max().item())
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale,
                                   msg=lambda m, w=what: f"{name}, {chunks} chunks, {w}: {m}")
    dead = want[1] == float("-inf")  # rows with no key to attend
    assert (got[0][dead] == 0).all() and (got[1][dead] == float("-inf")).all()
    if CASES[name][0] == "padding":
        assert dead.sum() == 4 * 5, dead.sum()  # the case does have such rows: 5 queries x 4 heads


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_equals_sdpa(name, chunks):
    with kernels.forced("torch"):
        check(name, chunks)


def test_merge_partials_of_disjoint_keys_and_empty_sides():
    """Merging is exact and symmetric, and a side with lse -inf (no key there) leaves the other unchanged."""
    q, k, v, _, mask, _, _ = _data("causal")
    whole = ca.chunk_attention(q, k, v, mask)
    left = ca.chunk_attention(q, k[:, :, :10], v[:, :, :10], mask[:, :10])
    right = ca.chunk_attention(q, k[:, :, 10:], v[:, :, 10:], mask[:, 10:])
    assert (right[1][..., :10] == float("-inf")).all()  # queries before key 10 see nothing on the right
    for a, b in (ca.merge_partials(*left, *right), ca.merge_partials(*right, *left)):
        torch.testing.assert_close(a, whole[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, whole[1], rtol=1e-6, atol=1e-6)
    nothing = (torch.zeros_like(q), torch.full(q.shape[:3], float("-inf")))
    out, lse = ca.merge_partials(*nothing, *nothing)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert torch.equal(ca.merge_partials(*whole, *nothing)[0], whole[0])


def test_sinks():
    """gpt-oss's attention sinks (a logit per head in the softmax's denominator, with no value), given with one
    of two key chunks: out and every gradient (sink_grad's for the sinks) against the sink as an extra score
    column of the softmax."""
    q, k, v, go, mask, _, _ = _data("sliding_window_gqa")
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    halves = [(k[:, :, a:b], v[:, :, a:b], mask[:, a:b]) for a, b in ((0, 10), (10, S))]
    out, lse = ca.merge_partials(*ca.chunk_attention(q, *halves[0]), *ca.chunk_attention(q, *halves[1], sinks=sinks))
    grads = [ca.chunk_attention_backward(q, kc, vc, out, lse, go, mc) for kc, vc, mc in halves]
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    s = _scores(qr, kr, mask, None, None)
    p = torch.cat([s, sr[None, :, None, None].expand(B, -1, S, 1)], -1).softmax(-1)[..., :S]
    want = p @ vr.repeat_interleave(2, 1)
    (want * go).sum().backward()
    torch.testing.assert_close(out, want.detach(), rtol=1e-6, atol=1e-6)
    for got, ref in ((grads[0][0] + grads[1][0], qr.grad), (torch.cat([g[1] for g in grads], 2), kr.grad),
                     (torch.cat([g[2] for g in grads], 2), vr.grad), (ca.sink_grad(sinks, out, lse, go), sr.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * max(1.0, ref.abs().max().item()))
    assert sr.grad.abs().min() > 0.01  # the sinks do carry weight here


def test_default_path_on_cuda_is_triton_for_16_bit_inputs(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(kernels.TRITON_ENV, raising=False)
    on_cuda = [SimpleNamespace(device=torch.device("cuda"), dtype=t) for t in (torch.bfloat16, torch.float16)]
    fp32_cuda = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    assert all(ca._triton(t) for t in on_cuda) and not ca._triton(fp32_cuda) and not ca._triton(torch.ones(1))
    with kernels.forced("triton"):  # asked for: every dtype and device
        assert ca._triton(fp32_cuda) and ca._triton(torch.ones(1))
    with kernels.forced("torch"):
        assert not any(ca._triton(t) for t in on_cuda)


def test_op_has_a_fake_kernel():
    q, k, v, _, mask, _, _ = _data("sliding_window_gqa")
    with torch._subclasses.FakeTensorMode() as mode:
        out, lse = ca.chunk_attention(*(mode.from_tensor(t) for t in (q, k, v, mask)))
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# The Triton path under the interpreter: a few cases covering each mask kind, GQA and MQA, the soft cap
# and chunking, with tiles of 16 so that a chunk spans a partial tile.

TRITON_CASES = {"sliding_window_gqa/1": ("sliding_window_gqa", 1), "padding_gqa/2": ("padding_gqa", 2),
                "softcap_additive_mqa/2": ("softcap_additive_mqa", 2)}


def _run_triton_cases() -> dict:
    assert type(ca._fwd_kernel).__name__ == "InterpretedFunction", type(ca._fwd_kernel)
    global B
    ca.BLOCK, B = 16, 1
    launches = []
    for fn in ("_forward_triton", "_backward_triton"):
        real = getattr(ca, fn)
        setattr(ca, fn, lambda *a, _real=real: launches.append(1) or _real(*a))
    results = {}
    for key, (name, chunks) in TRITON_CASES.items():
        try:
            launches.clear()
            with kernels.forced("triton"):
                check(name, chunks)
            assert len(launches) == 2 * chunks, launches  # the op took the Triton path, forward and backward
            results[key] = None
        except Exception as e:  # a failure is that case's, the others still run
            results[key] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop(kernels.TRITON_ENV, None)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.slow  # a subprocess: about 4 s, most of it importing fxpar
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_path_equals_sdpa(interpreted, case):
    assert interpreted[case] is None, interpreted[case]


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(_run_triton_cases()))
