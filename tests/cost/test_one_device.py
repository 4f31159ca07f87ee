"""One device type: ``compile`` / ``fxpar.api.price`` take a DeviceProfile (or its name) as ``profile=``;
``device_model=`` is its deprecated spelling for one release, and anything else is refused with the fix."""

from __future__ import annotations

import pytest

from fxpar import zoo
from fxpar.api import price
from fxpar.cost.profiles import PROFILES
from fxpar.ir.errors import PlanError
from fxpar.planner.auto import profile_arg


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", seed=0)
    return model, zoo.example_inputs("llama", model, batch=2, seq=8)


def test_profile_by_name_and_the_deprecated_alias(llama):
    model, batch = llama
    assert profile_arg("cpu") is profile_arg(PROFILES["cpu"]) is PROFILES["cpu"]
    assert profile_arg("h100") is PROFILES["h100-80gb"] and profile_arg(None) is None
    with pytest.warns(DeprecationWarning, match="device_model= is deprecated"):
        alias = price(model, "pp=2", example_kwargs=batch, device_model=PROFILES["h100-80gb"])
    # the stages were timed on the profile given, in the model's dtype
    assert alias.result.predicted["device"] == "h100-80gb"


def test_a_device_model_that_is_not_a_profile_is_refused_with_the_fix(llama):
    model, batch = llama

    class OldDeviceModel:  # what the retired DeviceModel looked like
        flops, mem_bw = 450e12, 2.7e12

    with pytest.raises(PlanError, match="not a DeviceProfile") as e:
        price(model, "pp=2", example_kwargs=batch, device_model=OldDeviceModel())
    assert "profile=" in str(e.value)
    with pytest.raises(PlanError, match="unknown device profile"):
        price(model, "pp=2", example_kwargs=batch, profile="h100-sxm-old")
