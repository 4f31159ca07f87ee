"""State-space mixers under tensor parallelism: the rules their graphs need, each against one process.

A norm over sharded channels (Mamba-2's gated RMSNorm) is a partial sum of squares, all-reduced; a
depthwise conv1d is cut by channels with its weight; tiny Mamba and Mamba-2 models at tp=2 equal one
process in loss and every gradient (slice by slice) while each rank holds about half the parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

import fxpar
from fxpar.ir import ops as fxops
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.runtime import groups
from fxpar.testing import multiproc
from fxpar.testing.compare import grads_by_fqn

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
PLAN = {"up": "colwise", "down": "rowwise"}


class NormOverChannels(nn.Module):
    """A column-parallel projection, an RMS norm over its (sharded) output features, a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        h = self.up(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.down(h).square().mean()


class DepthwiseConv(nn.Module):
    """Mamba's pattern: in_proj, a causal depthwise conv1d over time per channel, out_proj."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.conv = nn.Conv1d(16, 16, kernel_size=3, groups=16, padding=2)

    def forward(self, x):
        h = self.conv(self.up(x).transpose(1, 2))[..., : x.shape[1]]
        return self.down(torch.nn.functional.silu(h).transpose(1, 2)).square().mean()


def _tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mamba":
        cfg = transformers.MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2,
                                       expand=2, conv_kernel=4, time_step_rank=4)
    elif kind == "mamba2":
        cfg = transformers.Mamba2Config(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2,
                                        expand=2, num_heads=4, head_dim=32, n_groups=2, chunk_size=8, conv_kernel=4)
    else:
        return {"norm": NormOverChannels, "conv": DepthwiseConv}[kind]()
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def _batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind in ("norm", "conv"):
        return {"x": torch.randn(2, 6, 8, generator=g)}
    ids = torch.randint(0, 256, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out


def run_tp(kind: str, tp: int) -> dict:
    """This rank's loss and gradients against one process, and its share of the parameters."""
    groups.register_group("tp:" + ",".join(map(str, range(tp))), dist.group.WORLD)
    rank, batch = dist.get_rank(), _batch(kind)
    model = _tiny(kind)
    program = fxpar.trace(model, example_kwargs=batch)
    local, info = tensor_parallel(program, tp, rank, styles=PLAN if kind in ("norm", "conv") else None)
    loss = _loss(local(**batch))
    loss.backward()
    ref = _tiny(kind)
    expected = _loss(ref(**batch))
    expected.backward()
    ref_grads, grad = grads_by_fqn(ref), 0.0
    for fqn, p in local.named_parameters():
        layout = info.layout(fqn)
        want = ref_grads[fqn] if layout is None else layout.slice(ref_grads[fqn], rank)
        grad = max(grad, (p.grad - want).abs().max().item())
    params = {f: i for f, i in program.params.items() if not i.is_buffer}
    share = sum(math.prod(local.params[f].shape) for f in params) / sum(math.prod(i.shape) for i in params.values())
    # every weight of 2+ dims halves; 1-D ones (norm weights, Mamba-2's per-head D) may stay whole
    bound = (1 + sum(math.prod(i.shape) for i in params.values() if len(i.shape) < 2)
             / sum(math.prod(i.shape) for i in params.values())) / tp
    return {"loss": abs(loss.item() - expected.item()), "grad": grad, "share": share, "bound": bound,
            "whole": [f for f, i in params.items() if len(i.shape) >= 2 and f not in info.sharded],
            "counts": fxops.count_collectives(local.gm), "fallbacks": info.fallbacks}


def test_norm_over_sharded_channels_is_one_all_reduce():
    """The mean of squares over the column-parallel output is a local sum divided by the full count,
    all-reduced (no all-gather of the activations), and the norm's weight is cut with the channels."""
    batch = _batch("norm")
    local, info = tensor_parallel(fxpar.trace(_tiny("norm"), example_kwargs=batch), 2, 0, styles=PLAN)
    counts = fxops.count_collectives(local.gm)
    assert counts["all_gather"] == 0 and counts["scatter_slice"] == 0, counts
    assert counts["all_reduce"] == 2  # the sum of squares, the row-parallel output
    assert info.sharded.get("weight") == 0 and not info.fallbacks


def test_depthwise_conv_is_cut_by_channels():
    """A depthwise conv1d after a column-parallel projection runs on this rank's channels with its rows
    of the weight and bias (derived, no style names them): no gather, no slice."""
    batch = _batch("conv")
    local, info = tensor_parallel(fxpar.trace(_tiny("conv"), example_kwargs=batch), 2, 1, styles=PLAN)
    counts = fxops.count_collectives(local.gm)
    assert counts["all_gather"] == 0 and counts["scatter_slice"] == 0, counts
    assert info.sharded.get("conv.weight") == 0 and info.sharded.get("conv.bias") == 0
    assert tuple(local.params["conv.weight"].shape) == (8, 1, 3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["norm", "conv"])
def test_rules_equal_one_process(pool2, kind):
    for r in pool2.run(run_tp, kind, 2, timeout=120):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_mamba_tp2_equals_one_process_on_half_the_parameters(pool2, kind):
    """in_proj column-parallel (Mamba-2: cut part by part into z, xBC, dt), conv1d, A_log, D, dt_proj by
    channels or heads, x_proj and out_proj row-parallel; the scan runs on this rank's channels."""
    for r in pool2.run(run_tp, kind, 2, timeout=240):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert not r["whole"], f"weights left whole: {r['whole']}"
        assert r["share"] <= r["bound"] + 1e-9, r
        assert not r["fallbacks"], r["fallbacks"]
    if kind == "mamba":  # per layer: in_proj's input, dt, B, C (each once, not once per time step); the LM head
        assert r["counts"]["identity_fwd_all_reduce_bwd"] <= 4 * 2 + 1, r["counts"]
        assert r["counts"]["all_gather"] <= 1, r["counts"]  # the returned logits only
