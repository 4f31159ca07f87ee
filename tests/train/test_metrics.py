"""Fine-tuning metrics: JSON lines, TensorBoard scalars (through a stand-in writer: the package is optional
and not installed here), the message when it is missing, and the MFU's FLOP count against 6 N T."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.cost.profiles import PROFILES
from fxpar.train import metrics


class _Writer:
    calls: list = []

    def __init__(self, logdir):
        self.logdir = logdir

    def add_scalar(self, tag, value, step):
        _Writer.calls.append((tag, value, step))

    def close(self):
        _Writer.calls.append("closed")


def test_json_lines_and_tensorboard_scalars(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    _Writer.calls = []
    log = metrics.MetricsLog(tmp_path / "m.jsonl", tmp_path / "tb", rank=0)
    log.write({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "mem_mib_per_rank": [1.0, 2.0]})
    log.write({"step": 1, "eval_loss": 2.0, "eval_ppl": 7.389})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] == 2.5 and lines[1]["eval_ppl"] == 7.389
    assert ("train/loss", 2.5, 1) in _Writer.calls and ("eval/eval_loss", 2.0, 1) in _Writer.calls
    assert not any(c[0].endswith(("grad_norm", "mem_mib_per_rank")) for c in _Writer.calls if c != "closed")
    assert _Writer.calls[-1] == "closed"
    other = metrics.MetricsLog(tmp_path / "other.jsonl", None, rank=1)  # only rank 0 writes
    other.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "other.jsonl").exists()


def test_missing_tensorboard_is_said_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    log = metrics.MetricsLog(None, tmp_path / "tb", rank=0)
    log.write({"step": 1, "loss": 1.0})
    assert "tensorboard package is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_step_flops_near_six_n_t(name):
    """The cost model's FLOPs of a training step against the 6 x parameters x tokens rule of thumb (exact up
    to attention scores, embeddings looked up rather than multiplied, and elementwise work)."""
    model = zoo.build(name)
    batch = zoo.example_inputs(name, model, batch=2, seq=16)
    flops = metrics.step_flops(fxpar.trace(model, example_kwargs=batch))
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                and "wte" not in n and "wpe" not in n)
    lm_head_tied = model.config.tie_word_embeddings  # a tied head still multiplies
    dense += model.config.vocab_size * model.config.hidden_size if lm_head_tied else 0
    rule = 6 * dense * batch["input_ids"].numel()
    assert 0.9 < flops / rule < 1.6, (flops, rule)
    cpu = PROFILES["cpu"]  # MFU against the profile's published (here: sustained) fp32 peak
    assert metrics.mfu(flops, 1.0, 2, cpu) == pytest.approx(flops / (2 * cpu.peak("fp32")))
    assert metrics.perplexity(0.0) == 1.0 and metrics.perplexity(1e4) == float("inf")
    assert torch.isfinite(torch.tensor(metrics.perplexity(2.0)))
