"""The plan report of an HSDP plan, priced on one process (``fxpar.price``): the two data-parallel groups
of the rank shown, and each collective of a step on the group it runs over, with the bytes it moves."""

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.api import price
from fxpar.report.budget import trainable


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.mark.parametrize("zero", [1, 3])
def test_report_names_the_shard_and_replica_groups_and_their_bytes(zero):
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=8, seq=8)
    priced = price(zoo.build("llama"), f"dp=4,dp_replicate=2,tp=2,zero={zero}", example_kwargs=batch,
                   rank=6, optimizer=adamw)  # dp rank 3: replica 1, shard rank 1
    report = fxpar.inspect(priced, quiet=True)
    text = report.to_text()
    assert "HSDP: 2 replicas x shard groups of 2 (this rank: shards over dp_shard:4,6, copies over " \
           "dp_replicate:2,6)" in text, text
    rows = {(r["axis"], r["collective"], r["what"]): r for r in report.communication()}
    numel, size = trainable(priced)
    full = numel * size  # this rank's (TP-local) parameters, whole
    shard = rows[("dp_replicate", "all_reduce", "gradient shards")]
    assert shard["payload"] == -(-numel // 2) * size and shard["sent"] == shard["payload"]  # 2(R-1)/R = 1
    assert not any(axis == "dp" for axis, _, _ in rows)  # every data-parallel byte on one of the two groups
    if zero == 3:  # the graph's gathers and reduce-scatters run over the shard group, whole buckets
        assert full <= rows[("dp_shard", "all_gather", "forward")]["payload"] <= full + 5 * 4
        assert rows[("dp_shard", "reduce_scatter", "backward")]["payload"] == \
            rows[("dp_shard", "all_gather", "forward")]["payload"]
    else:
        assert rows[("dp_shard", "reduce_scatter", "gradients")]["payload"] == full
        assert rows[("dp_shard", "all_gather", "gradients")]["payload"] == full  # ZeRO-1 keeps them whole
        assert rows[("dp_shard", "all_gather", "parameters")]["sent"] == full // 2
    memory = priced.memory()["predicted"]
    assert memory["optimizer"] == 2 * 4 * numel // 2  # AdamW's states over the shard group of 2, not dp=4
