"""``FineTune`` is built from a :class:`FineTuneConfig`; ``fxpar train`` maps its command line onto it:
every option a field of the same name, the defaults the config's."""

import argparse
import dataclasses

import pytest

from fxpar.cli import train
from fxpar.train.config import FineTuneConfig
from fxpar.train.loop import FineTune


def _parse(argv):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    return p.parse_args(argv)


def test_the_command_line_maps_onto_the_config_field_by_field():
    assert vars(_parse(["llama"])) == dataclasses.asdict(FineTuneConfig(model="llama"))
    args = _parse(["dir", "--plan", "dp=2", "--grad-accum", "3", "--warmup", "0.1", "--no-pack", "--bf16",
                   "--max-grad-norm", "inf", "--save", "ckpt", "--save-total-limit", "2", "--format", "chat"])
    config = FineTuneConfig.from_args(args)
    assert dataclasses.asdict(config) == vars(args)
    assert (config.grad_accum, config.warmup, config.no_pack, config.save_total_limit) == (3, 0.1, True, 2)


def test_finetune_takes_a_config_its_fields_or_a_parsed_command_line():
    config = FineTuneConfig(model="llama", steps=-1, data="synthetic")
    assert FineTuneConfig.of(model="llama", steps=-1, data="synthetic") == config
    assert FineTuneConfig.of(_parse(["llama", "--steps", "-1", "--data", "synthetic"])) == config
    for given in ((config,), (), (_parse(["llama", "--steps", "-1", "--data", "synthetic"]),)):
        kw = {} if given else {"model": "llama", "steps": -1, "data": "synthetic"}
        with pytest.raises(Exception, match="--steps -1: give 0 or more optimizer steps"):
            FineTune(*given, **kw)  # the options are checked first, before anything is read
    with pytest.raises(TypeError, match="not both"):
        FineTune(config, steps=3)
