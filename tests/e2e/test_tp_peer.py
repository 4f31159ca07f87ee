"""The peer's own model: torch's DTensor test Transformer, parallelised by fxpar and by its own
``parallelize`` (DTensor's ``parallelize_module``), against one process, at tp=2 and tp=4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxpar
from fxpar.testing import multiproc, peers

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def peer_training(tp: int, plan: str, steps: int = 3) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    batch = peers.batch(peers.build())
    tp_plan = peers.PLAN if plan == "peer" else "auto"
    compiled = fxpar.compile(peers.build(), fxpar.Plan(tp=tp, tp_plan=tp_plan), example_kwargs=batch,
                             optimizer=sgd, timeout=60)
    ref = peers.build()
    ref_opt = sgd(ref.parameters())
    dt = peers.build()
    peers.Transformer.parallelize(dt, init_device_mesh("cpu", (tp,)), use_seq_parallel=False)
    dt_opt = sgd(dt.parameters())
    out = {"loss": 0.0, "grad": 0.0, "dtensor_loss": 0.0, "dtensor_grad": 0.0}
    for _ in range(steps):
        loss = compiled.step(**batch)
        for model, opt in ((ref, ref_opt), (dt, dt_opt)):
            opt.zero_grad()
            with sdpa_kernel(SDPBackend.MATH):  # the attention DTensor runs on CPU
                model(**batch)["loss"].backward()
        ref_loss = ref(**batch)["loss"].item()
        with sdpa_kernel(SDPBackend.MATH):
            dt_loss = dt(**batch)["loss"]
        dt_loss = dt_loss.full_tensor().item() if hasattr(dt_loss, "full_tensor") else dt_loss.item()
        grads = compiled.full_state_dict(grads=True)
        dt_grads = dict(dt.named_parameters())
        for name, p in ref.named_parameters():
            out["grad"] = max(out["grad"], (grads[name] - p.grad).abs().max().item())
            g = dt_grads[name].grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            out["dtensor_grad"] = max(out["dtensor_grad"], (g - p.grad).abs().max().item())
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss))
        out["dtensor_loss"] = max(out["dtensor_loss"], abs(dt_loss - ref_loss))
        ref_opt.step()
        dt_opt.step()
    state = compiled.full_state_dict()
    out["weights"] = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    out["sharded"] = sorted(compiled.tp_info.sharded)
    dist.barrier()
    return out


@pytest.mark.parametrize("plan", ["peer", "auto"])
def test_peer_transformer_tp2(plan, pool2):
    for r in pool2.run(peer_training, 2, plan, timeout=200):
        sharded = r.pop("sharded")
        assert max(r.values()) <= TOL, r
        assert "layers.0.attention.wq.weight" in sharded and "layers.1.feed_forward.w2.weight" in sharded
        if plan == "peer":
            assert "tok_embeddings.weight" in sharded


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["peer", "auto"])
def test_peer_transformer_tp4(plan, pool4):
    for r in pool4.run(peer_training, 4, plan, timeout=200):
        r.pop("sharded")
        assert max(r.values()) <= TOL, r
