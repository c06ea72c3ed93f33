"""Documented names removed before 1.0: each still works with a DeprecationWarning naming its
replacement, or fails in one line naming it (never a bare TypeError or AttributeError)."""

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetsplit
import hetsplit.distributed as hd
import hetsplit.planning
from hetsplit.apps.cli import build_parser


def test_throttle_cpu_time_still_works_and_says_it_is_deprecated():
    dev = hetsplit.parse_devices("cpu@0.5")[0]
    with pytest.warns(DeprecationWarning, match=r"throttle\(cpu_time=True\) is deprecated .* write dev\.throttle\(\)"):
        context = dev.throttle(cpu_time=True)
    with context:  # still the throttle: the work is slowed to the device's speed
        torch.randn(64, 64) @ torch.randn(64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dev.throttle():
            pass


def test_hetero_data_parallel_sync_is_ignored_with_a_warning_and_trains_the_same():
    torch.manual_seed(0)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    results = []
    for sync in (None, "copy"):
        torch.manual_seed(1)
        net = nn.Linear(5, 3).double()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@0.5"], weights=[2, 1], sync=sync)
        said = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
        assert bool(said) == (sync is not None) and all("leave sync= out" in s for s in said)
        F.cross_entropy(dp(x), y).backward()
        results.append(net.weight.grad.clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize(
    ("module", "name", "replacement"),
    [
        (hd, "init_timeout", "hd.init(timeout=120)"),
        (hd, "failure_message", "hd.guard()"),
        (hd, "verify_plan", "every rank holds the same plan"),
        (hd, "scale_loss", "hd.weight_gradients(ddp, plan)"),
        (hd, "HeteroBatchSampler", "hd.data_loader(dataset, plan)"),
        (hetsplit, "parse_device", "hetsplit.parse_devices('cpu@0.25')[0]"),
        (hetsplit.planning, "DeviceProfile", "hetsplit.planning.records.DeviceProfile"),
        (hetsplit.planning, "resolve_plan", "plan_from_sizes(None, devices, sizes)"),
        (hetsplit, "solver", "hetsplit.planning.plan_from_sizes"),
    ],
)
def test_a_removed_module_name_says_what_replaced_it_in_one_line(module, name, replacement):
    with pytest.raises(AttributeError) as caught:
        getattr(module, name)
    line = str(caught.value)
    assert "\n" not in line and f"{name!r}; it was removed: use " in line and replacement in line


def test_a_misspelt_name_is_still_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"has no attribute 'even_size'$"):
        hetsplit.planning.even_size  # noqa: B018


@pytest.mark.parametrize(
    ("module", "name"), [(hetsplit, "split_sizes"), (hd, "ENV_DEVICES"), (hetsplit.planning, "Curve")]
)
def test_a_name_removed_before_any_docs_named_it_keeps_no_tombstone(module, name):
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}'$"):
        getattr(module, name)


def test_the_bench_sync_flag_is_refused_naming_what_to_do(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--sync", "copy"])
    assert "--sync was removed: leave it out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "--sync" not in capsys.readouterr().out


def test_integrations_hetero_plan_names_plan_in_one_line():
    from hetsplit.accelerate import HeteroAccelerator
    from hetsplit.transformers import HeteroTrainer

    plan = hetsplit.planning.plan_from_sizes(None, ["rank0"], [4])
    acc = HeteroAccelerator(plan=plan)
    with pytest.raises(
        AttributeError, match=r"^'HeteroAccelerator' object has no attribute 'hetero_plan'; it was removed: use \.plan$"
    ):
        acc.hetero_plan  # noqa: B018
    assert not hasattr(acc, "hetero_plan") and acc.plan is plan
    with pytest.raises(
        AttributeError, match=r"'SimpleNamespace' object has no attribute 'hetero_plan'; it was removed"
    ):
        HeteroTrainer.hetero_plan.fget(types.SimpleNamespace(plan=plan))
