"""Micro-batches and out-of-memory recovery in HeteroDataParallel (parallel/micro.py, parallel/local.py)."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_grads, batch, cnn, step
from torch import nn

import hetsplit
from hetsplit import HeteroDataParallel, Profile, solve
from hetsplit.devices import parse_device
from hetsplit.parallel.micro import StepOutOfMemory

_net, _step = cnn, step
# Micro-batches change only the order of a handful of float64 additions: agreement to 1e-12.
TIGHT = {"rtol": 1e-12, "atol": 1e-13}


def _data(n=48):
    return batch(n, (1, 8, 8), classes=4)


def _reference(net, x, y, start=None):
    ref = copy.deepcopy(net)
    for p, g in zip(ref.parameters(), start or [None] * 4):
        p.grad = None if g is None else g.clone()
    F.cross_entropy(ref(x), y).backward()
    return [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_micro_batched_plan_gives_full_batch_gradients(mode):
    prof = Profile.from_measurements(
        {"cpu": [(8, 0.008), (32, 0.03)], "cpu@0.5": [(8, 0.016), (32, 0.06)]}, memory_caps={"cpu": 8}
    )
    plan = solve(prof, 48, accumulate=True)
    assert len(plan.micro_batches[0]) > 1 and max(plan.micro_batches[0]) <= 8
    net, (x, y) = _net(), _data()
    dp = HeteroDataParallel(copy.deepcopy(net), ["cpu", "cpu@0.5"], profile=prof)
    _step(dp, x, y, mode)
    assert dp.plan.micro_batches == plan.micro_batches
    assert_same_grads(dp.module, _reference(net, x, y), **TIGHT)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_oom_on_an_emulated_device_is_recovered_exactly(mode, caplog):
    net, (x, y) = _net(), _data()
    dev = hetsplit.devices.emulate("cpu", max_batch=12)
    dp = HeteroDataParallel(copy.deepcopy(net), ["cpu", dev], weights=[1, 1])
    start = [torch.full_like(p, 0.5) for p in net.parameters()]  # gradients accumulated before this step
    for p, g in zip(dp.module.parameters(), start):
        p.grad = g.clone()
    with caplog.at_level(logging.WARNING, logger="hetsplit"):
        _step(dp, x, y, mode)
    lines = [r.getMessage() for r in caplog.records if r.name == "hetsplit"]
    assert len(lines) == 1 and "cpu:max12" in lines[0] and "shard of 24" in lines[0] and "cap lowered to 12" in lines[0]
    assert dp.plan.sizes == [24, 24] and dp.plan.micro_batches == [[24], [12, 12]]
    assert_same_grads(dp.module, _reference(net, x, y, start), **TIGHT)  # nothing of the failed attempt leaked in
    caplog.clear()
    for p in dp.module.parameters():
        p.grad = None
    with caplog.at_level(logging.WARNING, logger="hetsplit"):
        _step(dp, x, y, mode)  # the next step starts within the cap: no warning
    assert not caplog.records
    assert_same_grads(dp.module, _reference(net, x, y), **TIGHT)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_the_cap_keeps_coming_down_within_the_step_until_it_fits(mode, caplog):
    # A true cap of 5 and a share of 24: 24 fails, then 12, then 6; 3 fits — in one step, one log line.
    net, (x, y) = _net(), _data()
    dp = HeteroDataParallel(copy.deepcopy(net), ["cpu", "cpu:max5"], weights=[1, 1])
    with caplog.at_level(logging.WARNING, logger="hetsplit"):
        _step(dp, x, y, mode)
    assert dp.plan.micro_batches[1] == [3] * 8
    assert len([r for r in caplog.records if r.name == "hetsplit"]) == 1
    assert_same_grads(dp.module, _reference(net, x, y), **TIGHT)


def test_a_device_that_holds_no_sample_is_an_error_naming_it():
    net, (x, y) = _net(), _data()
    # The model runs out on any batch of that device (a GPU already full): down to one sample, then an error.
    dp = HeteroDataParallel(_Capped(copy.deepcopy(net), 0), ["cpu:max1000", "cpu@1:max1000"], weights=[1, 1])
    with pytest.raises(StepOutOfMemory, match=r"again on device \d cpu.*1 sample.*first: out of memory on"):
        dp.train_step(x, y, F.cross_entropy)
    assert all(p.grad is None for p in dp.module.parameters())  # nothing of the failed step


def test_an_out_of_memory_error_raised_on_a_real_cpu_is_the_user_s():
    # A real CPU never raises torch.OutOfMemoryError for lack of memory (its allocator raises a
    # RuntimeError): one raised there is the model's own, re-raised as it is, and no cap is learned.
    net, (x, y) = _net(), _data()
    dp = HeteroDataParallel(_Capped(copy.deepcopy(net), 10), ["cpu", "cpu@0.5"], weights=[1, 1])
    with pytest.raises(torch.OutOfMemoryError, match="48 samples|24 samples") as info:
        dp.train_step(x, y, F.cross_entropy)
    assert not isinstance(info.value, StepOutOfMemory)
    assert dp._plans.caps == {} and dp.plan.micro_batches == [[24], [24]]


def test_without_accumulate_and_profile_an_oom_says_what_to_do():
    dp = HeteroDataParallel(_net(), ["cpu", "cpu:max4"], weights=[1, 1], accumulate=False)
    with pytest.raises(StepOutOfMemory, match="accumulate=True"):
        dp.train_step(*_data(), F.cross_entropy)


class _FailBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory once on a batch larger than ``limit`` (a GPU's backward OOM)."""

    armed = True

    @staticmethod
    def forward(ctx, x, limit):
        ctx.n, ctx.limit = x.shape[0], limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailBackward.armed and ctx.n > ctx.limit:
            _FailBackward.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")
        return g, None


class _Fragile(nn.Module):
    def __init__(self, net, limit):
        super().__init__()
        self.net, self.limit = net, limit

    def forward(self, x):
        return _FailBackward.apply(self.net(x), self.limit)


def test_oom_in_backward_after_forward_returned_is_refused_clearly():
    net, (x, y) = _net(), _data()
    # ":max1000": a device whose memory is tracked, as a GPU's is (the model's own error stands in for its OOM).
    dp = HeteroDataParallel(_Fragile(copy.deepcopy(net), 20), ["cpu:max1000", "cpu@0.5:max1000"], weights=[1, 1])
    _FailBackward.armed = True
    out = dp(x)
    with pytest.raises(StepOutOfMemory, match="in backward, after forward had returned.*run the step again"):
        F.cross_entropy(out, y).backward()
    assert all(p.grad is None for p in dp.module.parameters())  # the failed step left nothing behind
    F.cross_entropy(dp(x), y).backward()  # the step again: that device now runs micro-batches
    assert dp.plan.micro_batches[0] == [12, 12] or dp.plan.micro_batches[1] == [12, 12]
    assert_same_grads(dp.module, _reference(net, x, y), **TIGHT)


def test_guard_turns_an_oom_into_one_line_that_stops_the_rank():
    import hetsplit.distributed as hd

    dev = parse_device("cpu@0.5:max4")
    with (
        pytest.raises(
            hd.DistributedError,
            match=r"step 3: out of memory \(out of memory \(emulated\) on cpu@0.5:max4.*every rank stops",
        ),
        hd.guard(step=3),
    ):
        dev.check_batch(5)


def test_torchrun_micro_batches_cut_this_ranks_share():
    import hetsplit.distributed as hd

    syncing = []

    class _NoSync:
        def no_sync(self):
            import contextlib

            @contextlib.contextmanager
            def off():
                syncing.append(False)
                yield

            return off()

    plan = hetsplit.Plan(["a", "b"], [5, 3], [0.0, 0.0], 8, micro_batches=[[3, 2], [3]])
    x = torch.arange(5.0)
    pieces = [p.tolist() for p in hd.micro_batches(_NoSync(), x, plan, rank=0)]
    assert pieces == [[0.0, 1.0, 2.0], [3.0, 4.0]] and syncing == [False]  # only the first under no_sync
    with pytest.raises(ValueError, match="the plan gives this rank 5"):
        list(hd.micro_batches(_NoSync(), torch.arange(4.0), plan, rank=0))
    with pytest.raises(torch.OutOfMemoryError):
        list(hd.micro_batches(_NoSync(), x, plan, rank=0, device="cpu:max2"))


def test_rebalancing_keeps_micro_batches_within_the_caps():
    prof = Profile.from_measurements(
        {"cpu": [(8, 0.008), (32, 0.03)], "cpu@0.5": [(8, 0.016), (32, 0.06)]}, memory_caps={"cpu": 8, "cpu@0.5": 16}
    )
    net, (x, y) = _net(), _data()  # 48 samples: more than both caps together
    rb = hetsplit.Rebalancer(prof, every=1, threshold=0.0, window=1)
    dp = HeteroDataParallel(copy.deepcopy(net), ["cpu", "cpu@0.5"], profile=prof, rebalance=rb)
    for _ in range(4):
        for p in dp.module.parameters():
            p.grad = None
        dp.train_step(x, y, F.cross_entropy)
        # A loaded machine's noisy steps may move a device's whole share away (window 1, no threshold):
        # a share of 0 runs no micro-batch, which is within any cap.
        assert max(dp.plan.micro_batches[0], default=0) <= 8 and max(dp.plan.micro_batches[1], default=0) <= 16
        assert_same_grads(dp.module, _reference(net, x, y), **TIGHT)


class _Capped(nn.Module):
    """A module that runs out of memory on more than ``cap`` samples, as a full GPU would."""

    def __init__(self, net: nn.Module, cap: int) -> None:
        super().__init__()
        self.net, self.cap = net, cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.cap:
            raise torch.OutOfMemoryError(f"out of memory: {len(x)} samples, the device holds {self.cap}")
        return self.net(x)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_an_oom_on_the_module_s_own_device_is_recovered_too(mode, caplog):
    # One real device holding the module runs the module itself (no replica); its out-of-memory
    # error still lowers the cap, re-plans into micro-batches and re-runs the step, exactly.
    net, (x, y) = _net(), _data()
    prof = Profile.from_measurements({"cpu:max1000": [(8, 0.008), (32, 0.03)]})
    # A device whose memory is tracked (":max1000", as a GPU's is); the model's own error stands in for its OOM.
    dp = HeteroDataParallel(_Capped(copy.deepcopy(net), 30), ["cpu:max1000"], profile=prof)  # 48 fails, then half
    with caplog.at_level(logging.WARNING, logger="hetsplit"):
        _step(dp, x, y, mode)
    assert dp.plan.micro_batches == [[24, 24]], dp.plan
    assert len([r for r in caplog.records if r.name == "hetsplit"]) == 1
    assert_same_grads(dp.module.net, _reference(net, x, y), **TIGHT)


def test_dropout_with_recomputed_micro_batches_on_a_shared_generator_is_refused():
    # Gather mode recomputes a micro-batched device's forward in backward from the random state
    # saved at its forward; another replica drawing from the same (CPU) generator meanwhile
    # would give other dropout masks: refused, never silently wrong.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    plan = hetsplit.Plan(["cpu", "cpu:max4"], [4, 8], [0.1, 0.1], 12, micro_batches=[[4], [4, 4]])
    dp = HeteroDataParallel(net, ["cpu", "cpu:max4"], plan=plan)
    x = torch.randn(12, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="draws random numbers"):
        dp(x).sum().backward()
    net.eval()  # no randomness: the same split runs
    dp(x).sum().backward()
    dp.train()
    dp.train_step(x, torch.zeros(12, dtype=torch.long), F.cross_entropy)  # local-loss mode recomputes nothing
