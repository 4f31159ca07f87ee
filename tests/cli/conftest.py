"""Fixtures of the command-line tests: a tiny ``save_pretrained`` model directory, and a trap that fails a
test whose error came only after a process group could be joined (every bad input is refused first)."""

from __future__ import annotations

import pytest

from fxpar.testing.hfdir import make_model_dir

TRAP = "a process group was joined: the error came after communication could start"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"), "llama")


@pytest.fixture
def no_communication(monkeypatch):
    """Any way of joining a process group (fxpar's or torch's own) raises ``AssertionError(TRAP)``."""
    import torch.distributed as dist

    import fxpar.launch

    def trap(*a, **k):
        raise AssertionError(TRAP)

    monkeypatch.setattr(fxpar.launch, "init_distributed", trap)
    monkeypatch.setattr(dist, "init_process_group", trap)
