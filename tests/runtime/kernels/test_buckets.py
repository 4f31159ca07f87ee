"""ZeRO bucket copy-in / copy-out kernels (fxpar.runtime.kernels.buckets): the torch path against plain
torch (FlatBucket's own flatten / views), per rank and with padding; fake
kernels; then the Triton path against the torch path under the Triton interpreter, in one subprocess
(TRITON_INTERPRET must be set before triton decorates the kernels): bit-exact for fp32 and fp16, bf16
downcasts within 1 ulp (the interpreter truncates where torch rounds to nearest even)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.ir.buckets import FlatBucket
from fxpar.runtime import kernels
from fxpar.runtime.kernels import buckets
from fxpar.runtime.kernels.buckets import copy_out, pack_shard, unpack

# odd sizes: pieces straddle kernel blocks and rank shards; a 0-d tensor; 3256 entries in all
SHAPES = [(33, 17), (5,), (64, 40), (3,), (7, 9, 2), ()]


def bucket(shapes=SHAPES, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def reference_flat(tensors, dp, dtype) -> torch.Tensor:
    fb = FlatBucket([str(i) for i in range(len(tensors))], [t.shape for t in tensors], dp)
    return fb.flatten([t.to(dtype) for t in tensors], dtype=dtype, device="cpu")


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` (one float dtype) in units in the last place."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return 0
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(ints).long() - b.view(ints).long()).abs().max())


# ---- torch path ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_shard_is_the_flat_bucket_shard(dp, dtype):
    ts = bucket()
    flat = reference_flat(ts, dp, dtype)
    fb = FlatBucket([str(i) for i in range(len(ts))], [t.shape for t in ts], dp)
    shards = []
    for rank in range(dp):
        lo, hi = fb.shard_range(rank)
        shard = pack_shard(ts, dp, rank, dtype, backend="torch")
        assert shard.dtype == dtype and shard.shape == (fb.shard_numel,)
        assert torch.equal(shard, flat[lo:hi]), (dp, rank)  # bit-exact, padding zeros included
        shards.append(shard)
    assert torch.equal(torch.cat(shards), flat)


def test_pack_shard_rank_of_padding_only():
    ts = [torch.tensor([1.0, 2.0, 3.0])]  # 3 entries over 4 ranks: rank 3 owns only padding
    assert [pack_shard(ts, 4, r, torch.float32, backend="torch").tolist() for r in range(4)] == \
        [[1.0], [2.0], [3.0], [0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_out_and_unpack(dtype):
    ts = bucket(seed=3)
    dp = 4
    flat = reference_flat(ts, dp, dtype)
    outs = [torch.full(t.shape, float("nan"), dtype=torch.float32) for t in ts]
    copy_out(flat, outs, backend="torch")
    for o, t in zip(outs, ts):
        assert torch.equal(o, t.to(dtype).float())
    fb = FlatBucket([str(i) for i in range(len(ts))], [t.shape for t in ts], dp)
    for new, view in zip(unpack(flat, [t.shape for t in ts], backend="torch"), fb.views(flat)):
        assert new.dtype == dtype and torch.equal(new, view)
    strided = torch.zeros(33, 34)[:, ::2]  # a non-contiguous target goes through the torch path
    copy_out(flat, [strided], backend="triton" if buckets.triton is not None else "torch")
    assert torch.equal(strided, ts[0].to(dtype).float())


def test_checks():
    with pytest.raises(ValueError, match="backend"):
        kernels.use_triton("copy_out", torch.device("cpu"), "cuda")
    with pytest.raises(ValueError, match="one dtype"):
        pack_shard([torch.ones(2), torch.ones(2, dtype=torch.float16)], 2, 0, torch.float32)
    with pytest.raises(ValueError, match="cannot fill"):
        copy_out(torch.zeros(3), [torch.zeros(4)])
    assert not kernels.use_triton("copy_out", torch.device("cpu"))


def test_backend_choice(monkeypatch):
    if buckets.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.delenv(kernels.TRITON_ENV, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ops = ("pack_shard", "copy_out", "quantize_shard", "dequantize_copy_out", "linear_cross_entropy", "chunk_attention")
    # on CUDA "auto" picks Triton only for the ops measured faster there (CUDA_DEFAULT); never on the CPU
    for op in ops:
        assert kernels.use_triton(op, cuda) == (op in kernels.CUDA_DEFAULT), op
        assert not kernels.use_triton(op, cpu)
        assert kernels.use_triton(op, cpu, "triton") and not kernels.use_triton(op, cuda, "torch")
    assert kernels.CUDA_DEFAULT - {"copy_out"} and "copy_out" not in kernels.CUDA_DEFAULT
    with kernels.forced("triton"):  # the tests' switch: Triton on the CPU (under the interpreter)
        assert all(kernels.use_triton(op, cpu) for op in ops) and not kernels.use_triton("copy_out", cpu, "torch")
        monkeypatch.setenv(kernels.TRITON_ENV, "0")  # the one environment switch wins over a forced block
        assert not any(kernels.use_triton(op, cuda) for op in ops)
        assert kernels.use_triton("pack_shard", cuda, "triton")  # an explicit backend still wins
    monkeypatch.setenv(kernels.TRITON_ENV, "1")
    assert all(kernels.use_triton(op, cpu) for op in ops)
    monkeypatch.setenv(kernels.TRITON_ENV, "yes")
    with pytest.raises(ValueError, match="FXPAR_KERNELS_TRITON='yes'"):
        kernels.use_triton("copy_out", cpu)
    with pytest.raises(ValueError, match="backend must be"):
        kernels.forced("cuda").__enter__()


def test_fake_kernels_trace():
    def f(a, b, flat):
        shard = torch.ops.fxpar_kernels.pack_shard([a, b], 4, 1, torch.bfloat16)
        out = torch.empty_like(a)
        torch.ops.fxpar_kernels.copy_out(flat, [out])
        return shard, out
    with FakeTensorMode():
        shard, out = f(torch.empty(10, 3), torch.empty(5), torch.empty(40))
    assert (shard.shape, shard.dtype) == ((9,), torch.bfloat16)
    assert out.shape == (10, 3)


@pytest.mark.parametrize("op", ["pack_shard", "copy_out"])
def test_opcheck(op):
    """torch's own checks of a custom op: schema (mutations declared), fake kernel, autograd registration,
    AOT dispatch."""
    ts = [torch.randn(5, 3), torch.randn(7)]
    args = {"pack_shard": (ts, 2, 1, torch.bfloat16, "torch"),
            "copy_out": (torch.randn(24), [torch.empty(5, 3), torch.empty(7)], "torch")}[op]
    torch.library.opcheck(getattr(torch.ops.fxpar_kernels, op), args)


# ---- Triton path under the interpreter (one subprocess) ----------------------------------------------

def _compare(triton_out, torch_out, max_ulps) -> str | None:
    if triton_out.dtype != torch_out.dtype or triton_out.shape != torch_out.shape:
        return f"dtype/shape {triton_out.dtype}{tuple(triton_out.shape)} != {torch_out.dtype}{tuple(torch_out.shape)}"
    d = ulps(triton_out, torch_out)
    return None if d <= max_ulps else f"{d} ulps apart (allowed {max_ulps})"


def _case_pack_shard(dtype, dp, src=torch.float32):
    ts = bucket(dtype=src, seed=4)
    for rank in range(dp):
        err = _compare(pack_shard(ts, dp, rank, dtype, backend="triton"),
                       pack_shard(ts, dp, rank, dtype, backend="torch"), 1 if dtype == torch.bfloat16 else 0)
        if err:
            return f"rank {rank}: {err}"


def _case_copy_out(src, dst):
    flat = reference_flat(bucket(seed=6), 2, src)
    a = unpack(flat, SHAPES, dst, backend="triton")
    b = unpack(flat, SHAPES, dst, backend="torch")
    errs = [_compare(x, y, 1 if dst == torch.bfloat16 and src != dst else 0) for x, y in zip(a, b)]
    return next((e for e in errs if e), None)


def _case_interpreted():
    fn = type(buckets._pack_kernel).__name__
    return None if fn == "InterpretedFunction" else f"the kernel is a {fn}, not interpreted"


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = {
    "interpreted": (_case_interpreted,),
    **{f"pack_shard-{str(dt)[6:]}-dp{dp}": (_case_pack_shard, dt, dp)
       for dt in (F32, F16, BF16) for dp in (1, 3, 4)},
    # the ZeRO-1/2 engine's master shards: parameters of any dtype up to fp32, exact
    **{f"pack_shard-{str(src)[6:]}-to-float32-dp3": (_case_pack_shard, F32, 3, src) for src in (F16, BF16)},
    "copy_out-f32-f32": (_case_copy_out, F32, F32),
    "copy_out-bf16-bf16": (_case_copy_out, BF16, BF16),
    "copy_out-f16-f32": (_case_copy_out, F16, F32),
    "copy_out-f32-bf16": (_case_copy_out, F32, BF16),
}


def run_cases(cases: dict) -> dict:
    """Each case's error message (None: passed), run in this process (the interpreter's)."""
    results = {}
    for name, (fn, *args) in cases.items():
        try:
            results[name] = fn(*args)
        except Exception as e:  # a crash is that case's failure, the others still run
            results[name] = f"{type(e).__name__}: {e}"
    return results


def interpreter_results(path: str) -> dict:
    """Run the test module ``path`` as a script under TRITON_INTERPRET=1 and read its cases' results."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop(kernels.TRITON_ENV, None)
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreted():
    return interpreter_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_path_matches_torch_path(interpreted, case):
    assert interpreted[case] is None, interpreted[case]


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(run_cases(CASES)))
