"""The integrations' shared core: one vocabulary, one set of checks, one list of carried loader settings."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hetsplit.distributed.setup import device_name

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from hetsplit.accelerate import HeteroAccelerator
from hetsplit.integrations import core
from hetsplit.lightning import HeteroDDPStrategy
from hetsplit.planning import plan_from_sizes


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"plan": [6, 2]}, TypeError, "(plan=...) must be a hetsplit Plan, got list"),
        ({"profile": "cpu.json"}, TypeError, "(profile=...) must be a hetsplit Profile, got str"),
        (
            {"global_batch_size": 0},
            ValueError,
            "(global_batch_size=...) must be a positive number of samples per step, got 0",
        ),
        ({"weighting": "mean"}, ValueError, "(weighting='mean'): use one of 'hook', 'outputs'"),
        ({"plan_kwargs": [("weights", [4, 1])]}, TypeError, "(plan_kwargs=...) must be a dict, got list"),
        (
            {"plan": plan_from_sizes(None, ["a", "b"], [6, 2]), "global_batch_size": 16},
            ValueError,
            "global_batch_size=16 but the plan splits 8",
        ),
    ],
)
@pytest.mark.parametrize("integration", [HeteroDDPStrategy, HeteroAccelerator])
def test_the_same_mistake_is_the_same_error_in_every_integration(integration, kwargs, error, fragment):
    with pytest.raises(error, match=f"^{integration.__name__}.*" + fragment.replace("(", r"\(").replace(")", r"\)")):
        integration(**kwargs)


def test_plan_kwargs_have_one_name_and_one_default():
    assert HeteroDDPStrategy().plan_kwargs == core.PLAN_KWARGS
    assert HeteroDDPStrategy(profile_kwargs={"calibrate": 0}).plan_kwargs == {**core.PLAN_KWARGS, "calibrate": 0}
    assert HeteroAccelerator(plan_kwargs={"weights": [1]}).plan_kwargs == {**core.PLAN_KWARGS, "weights": [1]}


def test_framework_device_names_are_hetsplit_names():
    assert device_name(torch.device("cpu", 0)) == "cpu"
    assert [device_name(s) for s in ("cpu:0", "cpu:1@0.25", "cpu:max4", "cuda:1")] == [
        "cpu",
        "cpu@0.25",
        "cpu:max4",
        "cuda:1",
    ]


def test_a_recut_loader_keeps_every_carried_setting():
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2, generator=g, in_order=False, num_workers=0)
    carried = core.carried_settings(loader)
    assert carried["generator"] is g and carried["in_order"] is False and "pin_memory_device" in carried
    assert "persistent_workers" not in carried  # DataLoader refuses it without workers


def test_a_sharded_model_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --use_deepspeed sets
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED shards the model instead"):
        HeteroAccelerator()
