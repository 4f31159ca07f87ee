"""The sections of ``bench/gpu.py`` (``./dev gpu``) that run fxpar's compiled programs: plans on one rank of a
real process group, and a Llama-3-8B-shaped slice timed against the Hugging Face module."""

from __future__ import annotations

import gc
import os
import socket
import time
import unittest.mock
import warnings

import torch
import torch.distributed as dist
from _gpu_checks import TINY_BUCKET, Env, _fmt, table

# every plan a one-rank run can take, each through the code paths a multi-rank run of it takes ("": the
# default, which compiles on CUDA and runs eagerly on the CPU)
PLANS = ("compile=0", "", "zero=1", "zero=2", "zero=3", "zero=3,comm_dtype=int8", "recompute=layer", "fused_loss=1",
         "mixed_precision=bf16", "compile=1", "compile=1,mixed_precision=bf16", "compile=1,fused_loss=1")
# Inductor on the CPU costs CI 10-20 s a plan (cold cache): the dry run leaves the compiled plans to the
# slice, whose Plan(compile=True) row takes the same path up to Inductor (FXPAR_COMPILE_BACKEND=aot_eager
# there), and Inductor to tests/runtime/test_compile_stages.py
DRY_SKIPS = tuple(p for p in PLANS if "compile=1" in p)
TOL = {"fp32": 1e-5, "bf16": 2e-3}  # |loss - reference loss| allowed over three AdamW steps


# ---- 2. plans on one rank of a real process group ----------------------------------------------------

def join_group(env: Env) -> str:
    """Join a one-rank process group as torchrun would describe it (NCCL on CUDA, gloo on CPU)."""
    from fxpar.launch import init_distributed

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(k, v)
        init_distributed(timeout=120)
    return str(dist.get_backend())


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _kernel_calls(step) -> dict[str, int]:
    """fxpar kernels ``step()`` calls, by name (the profiler sees custom ops, compiled or not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key.split("::")[1]: e.count for e in prof.key_averages() if e.key.startswith("fxpar_kernels::")}


def plans(env: Env):
    import fxpar
    from fxpar import zoo

    backend = join_group(env)
    cfg = zoo.tiny_config("llama")
    batch = zoo.example_inputs("llama", cfg, batch=2, seq=64, device=env.device)
    torch.manual_seed(0)
    state = zoo.model_class("llama", cfg)(cfg).state_dict()

    def fresh():
        m = zoo.model_class("llama", cfg)(cfg)
        m.load_state_dict(state)
        return m.to(env.device).train()

    refs = {}
    for prec in ("fp32", "bf16"):
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        refs[prec] = []
        for _ in range(3):
            with torch.autocast(env.device.type, torch.bfloat16, enabled=prec == "bf16"):
                loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            refs[prec].append(loss.item())
    rows, ok, errors = [], True, []
    for plan in PLANS:
        if env.dry and plan in DRY_SKIPS:
            continue
        prec = "bf16" if "bf16" in plan else "fp32"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            c = fxpar.compile(fresh(), plan, example_kwargs=batch, device=env.device,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
            losses = [float(c.step(**batch))]
            calls = _kernel_calls(lambda c=c: losses.append(float(c.step(**batch))))
            losses.append(float(c.step(**batch)))
        eager = [str(w.message) for w in seen if "could not be compiled" in str(w.message)]
        if eager:
            errors.append(f"<details><summary>{plan}: why it could not be compiled</summary>\n\n```\n"
                          f"{_compile_error(fresh(), plan, batch, env)}\n```\n</details>\n")
        diff = max(abs(a - b) for a, b in zip(losses, refs[prec]))
        good = diff <= TOL[prec] and not eager
        ok &= good
        rows.append([f"`{plan or '(default)'}`", prec, f"{diff:.1e}", "ok" if good else "FAILED",
                     ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())) or "-",
                     eager[0][:120] if eager else ""])
        del c
    gc.collect()
    good, detail = _int8_gather(env)
    ok &= good
    rows.append(["ZeRO-3 int8 gather, its steps on this group", "int8", "-", "ok" if good else "FAILED", detail, ""])
    body = (f"A tiny Llama on one rank of a `{backend}` process group, 3 AdamW steps each, the largest loss "
            f"difference from the eager module on the same weights (fp32: at most {TOL['fp32']}; bf16 against "
            f"the module under bf16 autocast: at most {TOL['bf16']}).\n\n")
    return body + table(["plan", "precision", "max loss diff", "check", "fxpar kernels per step",
                         "compile fell back"], rows) + "\n\n" + "\n".join(errors), ok


def _compile_error(model, plan: str, batch: dict, env: Env) -> str:
    """The whole error of a stage that fell back to eager: the plan again with the fallback off."""
    import traceback

    import fxpar
    from fxpar.runtime.compile import FALLBACK_ENV

    os.environ[FALLBACK_ENV] = "0"
    try:
        fxpar.compile(model, plan, example_kwargs=batch, device=env.device,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)).step(**batch)
        return "compiled this time"
    except Exception:
        return traceback.format_exc()[-8000:]
    finally:
        del os.environ[FALLBACK_ENV]


def _int8_gather(env: Env) -> tuple[bool, str]:
    """ZeRO-3's int8 gather (``comm_dtype="int8"``) as :func:`fxpar.runtime.collectives._gather_params_int8`
    runs it on each rank of a larger group: quantize this rank's shard into one int8 buffer, all-gather it
    over the process group, dequantize. With one rank the op itself skips the wire format (nothing is
    sent), so its steps are called here one by one; the result must equal quantize -> dequantize."""
    from fxpar.runtime import collectives as C
    from fxpar.runtime.kernels.buckets import pack_shard
    from fxpar.runtime.kernels.quant import quantize_dequantize

    g = torch.Generator(device=env.device).manual_seed(1)
    ts = [torch.randn(s, device=env.device, generator=g) for s in TINY_BUCKET + [(512, 256)]]
    shard = pack_shard(ts, 1, 0, torch.float32)
    out = {}

    def gather():
        packed = C._int8_pack(shard, 1, 0)
        buf = torch.empty_like(packed)
        dist.all_gather_into_tensor(buf, packed)
        out["full"] = C._int8_unpack(buf, 1, shard.numel(), torch.bfloat16)
    calls = _kernel_calls(gather)
    same = torch.equal(out["full"], quantize_dequantize(ts, 1, 256, torch.bfloat16))
    return same, ("equals quantize -> dequantize; " if same else "DIFFERS from quantize -> dequantize; ") + \
        ", ".join(f"{k} x{v}" for k, v in sorted(calls.items()))


# ---- 4. a Llama-3-8B-shaped slice ----------------------------------------------------------------------

def _slice_config(env: Env):
    from fxpar import zoo

    if env.dry:
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=512)
    else:
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, rope_theta=500000.0)
    return zoo.tiny_config("llama", num_hidden_layers=env.layers, max_position_embeddings=env.seq,
                           tie_word_embeddings=False, **shape)


def slice_step(env: Env):
    import fxpar
    from fxpar import zoo
    from fxpar.cost.profiles import profile_for_device
    from fxpar.train import metrics

    join_group(env)
    cfg = _slice_config(env)
    batch = zoo.example_inputs("llama", cfg, batch=1, seq=env.seq, device=env.device)
    profile = profile_for_device(env.device)

    def build():
        torch.manual_seed(0)
        with env.device:
            return zoo.model_class("llama", cfg)(cfg).train()

    def hf(compiled: bool):
        model = build()
        # on the dry run Dynamo and AOT autograd without Inductor: the same capture, seconds instead of 20
        run = torch.compile(model, backend="aot_eager" if env.dry else "inductor") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            with torch.autocast(env.device.type, torch.bfloat16):
                loss = run(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step, None

    def fx(plan: str):
        # on the dry run fxpar's compiled stages go through Dynamo and AOT autograd without Inductor too
        backend = {"FXPAR_COMPILE_BACKEND": "aot_eager"} if env.dry else {}
        with unittest.mock.patch.dict(os.environ, backend):
            c = fxpar.compile(build(), plan, example_kwargs=batch, device=env.device,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-5))
        return (lambda: c.step(**batch)), c

    variants = [("HF module, eager", lambda: hf(False)), ("HF module, torch.compile", lambda: hf(True)),
                ("fxpar, eager", lambda: fx("compile=0,mixed_precision=bf16")),
                ("fxpar, Plan(compile=True)", lambda: fx("compile=1,mixed_precision=bf16"))]
    rows, flops, first, ok = [], None, None, True
    for name, make in variants:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            step, compiled = make()
            loss = float(step())
            setup = time.perf_counter() - t0
            box = {}
            with env.peak(box):
                ms = env.timed(step)
        if compiled is not None and flops is None:
            flops = metrics.step_flops(compiled.program)
        predicted = compiled.predicted.step_time * 1e3 if compiled is not None else None
        fell_back = any("could not be compiled" in str(w.message) for w in seen)
        first = first if first is not None else loss
        good = abs(loss - first) <= 2e-2 and not fell_back
        ok &= good
        rows.append([name, f"{loss:.4f}", f"{ms:.1f}", None, _fmt(box["mib"] and box["mib"] / 1024),
                     f"{setup:.1f}", _fmt(predicted, ".1f"), "" if good else "FAILED" + (" (ran eager)" * fell_back)])
        del step, compiled
        gc.collect()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        r[3] = f"{metrics.mfu(flops, float(r[2]) / 1e3, 1, profile, 'bf16'):.1%}" if flops else "n/a"
    body = (f"{env.layers} Llama-3-8B-shaped layers (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}), batch 1 x "
            f"{env.seq}, bf16 autocast over fp32 weights, AdamW; MFU: the traced program's "
            f"{(flops or 0) / 1e12:.2f} TFLOP per step against {profile.name}'s bf16 peak; first-step loss of each "
            f"within 2e-2 of the first row's; set-up s includes compiling and the first step.\n\n")
    return body + table(["step", "first loss", "ms", "MFU", "peak GiB", "set-up s", "fxpar predicted ms", "check"],
                        rows), ok
