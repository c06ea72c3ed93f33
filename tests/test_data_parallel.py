import copy
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_same_grads, batch, cnn, max_rel_grad_error
from helpers import step as _step
from torch import nn

import hetsplit
from hetsplit import HeteroDataParallel, Plan, Profile
from hetsplit.planning import plan_from_sizes

DEVICES = ["cpu", "cpu@0.25"]


_net = cnn


def _data(n=50):
    return batch(n, (1, 8, 8), classes=4)


def _reference(net, x, y):
    ref = copy.deepcopy(net)
    F.cross_entropy(ref(x), y).backward()
    return ref


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_uneven_gradients_equal_full_batch(mode):
    net, (x, y) = _net(), _data()
    ref = _reference(net, x, y)
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[4, 1])
    if mode == "gather":
        F.cross_entropy(dp(x), y).backward()
    else:
        loss = dp.train_step(x, y, F.cross_entropy)
        with torch.no_grad():
            expected = float(F.cross_entropy(net(x), y))
        assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert dp.plan.sizes == [40, 10]
    # float64 and a handful of additions in another order: agreement far below 1e-6.
    assert max_rel_grad_error(dp.module, ref) < 1e-6


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_parameters_keep_agreeing_over_optimizer_steps(mode):
    net, (x, y) = _net(), _data(60)
    ref = copy.deepcopy(net)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[3, 1])
    opt = torch.optim.SGD(dp.parameters(), lr=0.5, momentum=0.9)
    for step in range(4):
        xs, ys = x[step * 15 : (step + 1) * 15], y[step * 15 : (step + 1) * 15]
        for o in (opt, opt_ref):
            o.zero_grad()
        F.cross_entropy(ref(xs), ys).backward()
        if mode == "gather":
            F.cross_entropy(dp(xs), ys).backward()
        else:
            dp.train_step(xs, ys, F.cross_entropy)
        opt.step()
        opt_ref.step()
        for p, q in zip(dp.module.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-9, atol=1e-12)


def test_sum_reduction_in_local_mode():
    net, (x, y) = _net(), _data()
    ref = copy.deepcopy(net)
    F.cross_entropy(ref(x), y, reduction="sum").backward()
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[1, 3])
    dp.train_step(x, y, lambda out, t: F.cross_entropy(out, t, reduction="sum"), reduction="sum")
    assert max_rel_grad_error(dp.module, ref) < 1e-6


def test_zero_size_shard_and_tiny_batch():
    net, (x, y) = _net(), _data(3)
    ref = _reference(net, x, y)
    dp = HeteroDataParallel(copy.deepcopy(net), ["cpu", "cpu@0.5", "cpu"], weights=[1, 0, 1])
    F.cross_entropy(dp(x), y).backward()
    assert dp.plan.sizes == [2, 0, 1] and max_rel_grad_error(dp.module, ref) < 1e-6
    dp2 = HeteroDataParallel(copy.deepcopy(net), ["cpu", "cpu", "cpu", "cpu"], weights=[1, 1, 1, 1])
    out = dp2(x[:2])  # fewer samples than devices
    assert out.shape == (2, 4) and dp2.plan.sizes == [1, 1, 0, 0]


def test_set_plan_between_steps_and_plan_property():
    net, (x, y) = _net(), _data(20)
    ref = _reference(net, x, y)
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, plan=plan_from_sizes(None, DEVICES, [10, 10]))
    dp(x).sum().backward()
    assert dp.plan.sizes == [10, 10]
    dp.module.zero_grad()
    dp.set_plan(plan_from_sizes(None, DEVICES, [17, 3]))
    F.cross_entropy(dp(x), y).backward()
    assert dp.plan.sizes == [17, 3] and max_rel_grad_error(dp.module, ref) < 1e-6
    with pytest.raises(ValueError, match="the plan splits 20 samples, but the batch has 10"):
        dp(x[:10])


def test_profile_is_solved_per_batch_size():
    prof = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    dp = HeteroDataParallel(_net(), DEVICES, profile=prof)
    x, _ = _data(50)
    dp(x)
    assert dp.plan.sizes == [40, 10] and dp.plan.step_time > 0


def test_kwargs_and_dict_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2).double()

        def forward(self, a, *, scale, note="x"):
            return {"out": self.lin(a) * scale, "note": note, "count": torch.tensor(a.shape[0])}

    net = Net()
    a, scale = torch.randn(10, 3, dtype=torch.float64), torch.rand(10, 1, dtype=torch.float64)
    ref = copy.deepcopy(net)
    ref(a, scale=scale)["out"].pow(2).sum().backward()
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[7, 3])
    res = dp(a, scale=scale, note="hi")
    assert res["note"] == ["hi", "hi"] and res["count"].tolist() == [
        7,
        3,
    ]  # one per replica, never replica 0 alone (issue 12)
    assert torch.allclose(res["out"], net(a, scale=scale)["out"])
    res["out"].pow(2).sum().backward()
    assert max_rel_grad_error(dp.module, ref) < 1e-6


def test_replica_exception_names_device():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            if x.shape[0] < 5:
                raise ValueError("shard too small")
            return self.lin(x)

    dp = HeteroDataParallel(Boom(), DEVICES, weights=[4, 1])
    with pytest.raises(ValueError, match=r"in replica 1 on device cpu@0.25: shard too small"):
        dp(torch.randn(10, 2))


def test_state_dict_is_the_plain_modules():
    net = _net()
    dp = HeteroDataParallel(net, DEVICES, weights=[1, 1])
    assert list(dp.state_dict()) == list(net.state_dict())
    other = _net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    dp.load_state_dict(other.state_dict())
    x, _ = _data(6)
    assert torch.allclose(dp(x), other(x))


def test_batchnorm_running_stats_are_shard_weighted():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.5)).double()
    x = torch.randn(40, 3, dtype=torch.float64) * 3 + 1
    ref = copy.deepcopy(net)
    ref(x)
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[3, 1])
    dp(x)
    bn, bn_ref = dp.module[1], ref[1]
    # The weighted mean of shard means is the full-batch mean: the running mean is exact.
    assert torch.allclose(bn.running_mean, bn_ref.running_mean, rtol=1e-12)
    assert int(bn.num_batches_tracked) == 1
    # Variance: the weighted mean of within-shard variances, close to the full-batch one.
    assert torch.allclose(bn.running_var, bn_ref.running_var, rtol=0.2)
    for replica in dp.replicate(dp.module, dp.devices):  # replicas start the next step from the module's buffers
        assert torch.equal(replica[1].running_mean.cpu(), bn.running_mean)
    dp.eval()
    assert torch.allclose(dp(x), dp.module(x))


@pytest.mark.parametrize("batch_size", [16, 9, 5, 2])
def test_a_batchnorm_model_never_gets_a_share_of_one_sample(batch_size):
    # BatchNorm cannot train on one sample ("Expected more than 1 value per channel"): the plain
    # module trains on the whole batch, so a split must not hand a replica a single sample.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[15, 1])
    x, y = torch.randn(batch_size, 3, dtype=torch.float64), torch.randint(0, 2, (batch_size,))
    F.cross_entropy(dp(x), y).backward()
    assert 1 not in dp.plan.sizes and sum(dp.plan.sizes) == batch_size
    plain = HeteroDataParallel(nn.Sequential(nn.Linear(3, 2)), DEVICES, weights=[15, 1])
    assert plain.sizes_for(16) == [15, 1]  # without BatchNorm the weights' split stands


def _conv_bn(stride):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=stride, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=stride, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3),
    )  # fmt: skip


def test_no_share_is_too_small_for_batchnorm_statistics_on_its_smallest_map():
    # A ResNet's last stage on small images: 4x4 inputs end at 1x1 maps, so a share of 2 samples
    # normalises 2 values per channel (ResNet-18 diverged on one: loss 3.06, accuracy 0.08).
    x, y = torch.randn(32, 1, 4, 4), torch.randint(0, 3, (32,))
    small = _conv_bn(stride=2)
    small(x)  # the lazy layer
    dp = HeteroDataParallel(small, DEVICES, weights=[15, 1])
    F.cross_entropy(dp(x), y).backward()
    assert dp.plan.sizes == [32, 0], dp.plan.sizes  # 2 samples sit out rather than 6 moved onto the slow device
    assert dp.plan.notes and "sits out (its 2 samples moved)" in dp.plan.notes[0], dp.plan.notes
    # Maps of 4x4 (16 values a sample per channel): 2 samples are plenty, the weights' split stands.
    large = _conv_bn(stride=1)
    large(x)
    dp = HeteroDataParallel(large, DEVICES, weights=[15, 1])
    F.cross_entropy(dp(x), y).backward()
    assert dp.plan.sizes == [30, 2] and not dp.plan.notes


def test_a_single_sample_moves_only_where_a_memory_cap_leaves_room():
    from hetsplit.parallel.sizes import BatchPlans

    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plans = BatchPlans(hetsplit.parse_devices("cpu,cpu@0.5,cpu@0.25"), weights=[14, 1, 1], model=bn)
    assert plans.for_batch(16).sizes == [16, 0, 0]
    plans = BatchPlans(hetsplit.parse_devices("cpu,cpu@0.5,cpu@0.25"), weights=[14, 1, 1], model=bn)
    plans.caps = {"cpu": 14}  # learned from running out: no room on the fastest device
    assert plans.for_batch(16).sizes == [14, 0, 2]  # the two single samples pair up instead


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"plan": Plan(["cpu", "cpu@0.5"], [1, 1], [0.0, 0.0], 2)}, "the plan is for devices"),
        ({"weights": [1, 2, 3]}, "got 3 weights"),
        ({"weights": [1, -2]}, "-2"),
        ({"scalar_outputs": "magic"}, "'magic'"),
    ],
)
def test_bad_construction(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        HeteroDataParallel(_net(), DEVICES, **kwargs)
    assert fragment in str(err.value)


def test_bad_batches():
    dp = HeteroDataParallel(_net(), DEVICES, weights=[1, 1])
    with pytest.raises(ValueError, match=r"\[6, 5\]"):
        dp(torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.randn(5))
    # A plan serves its own batch size; with nothing to solve other sizes, another is refused, naming both ways out.
    fixed = HeteroDataParallel(_net(), DEVICES, plan=plan_from_sizes(None, DEVICES, [3, 3]))
    with pytest.raises(ValueError, match="the plan splits 6 samples, but the batch has 4.*profile=.*weights="):
        fixed(torch.randn(4, 1, 8, 8, dtype=torch.float64))


def test_set_plan_keeps_the_weights_for_other_batch_sizes():
    dp = HeteroDataParallel(_net(), DEVICES, weights=[1, 1])
    dp.set_plan(plan_from_sizes(None, DEVICES, [5, 1]))
    dp(torch.randn(6, 1, 8, 8, dtype=torch.float64))
    assert dp.plan.sizes == [5, 1]
    dp(torch.randn(4, 1, 8, 8, dtype=torch.float64))  # the short last batch: split by the weights
    assert dp.plan.sizes == [2, 2]


def test_module_on_several_devices_is_refused(monkeypatch):
    net = _net()
    real = net.parameters
    monkeypatch.setattr(net, "parameters", lambda: iter([next(real()), torch.zeros(1, device="meta")]))
    with pytest.raises(ValueError, match="on several devices"):
        HeteroDataParallel(net, DEVICES)


def test_emulated_replica_backward_is_throttled_and_concurrent(monkeypatch):
    """Every replica's backward runs in its own thread (one is the caller's), inside its device's throttle."""
    import hetsplit.devices as devices_mod

    entered = []
    original = devices_mod.Device.throttle

    def spy(self):
        entered.append((self.name, threading.current_thread().name, torch.is_grad_enabled()))
        return original(self)

    monkeypatch.setattr(devices_mod.Device, "throttle", spy)
    net, (x, y) = _net(), _data(20)
    dp = HeteroDataParallel(net, DEVICES, weights=[1, 1])
    out = dp(x)
    forward = list(entered)
    F.cross_entropy(out, y).backward()
    backward = entered[len(forward) :]
    assert sorted(n for n, _, _ in forward) == sorted(DEVICES)
    assert sorted(n for n, _, _ in backward) == sorted(DEVICES)
    threads = sorted(t for _, t, _ in backward)
    assert threads[0] == threading.current_thread().name and threads[1].startswith("hetsplit")


def test_step_times_report_each_active_device():
    net, (x, y) = _net(), _data(20)
    dp = HeteroDataParallel(net, ["cpu", "cpu@0.25", "cpu"], weights=[3, 1, 0])
    F.cross_entropy(dp(x), y).backward()
    assert set(dp.step_times) == {"cpu", "cpu@0.25"} and all(t > 0 for t in dp.step_times.values())
    dp.train_step(x, y, F.cross_entropy)
    assert set(dp.step_times) == {"cpu", "cpu@0.25"}
    # A step the module runs itself (the whole batch on its device) has no busy times: it
    # repeated the last split step's, and bench's timeline showed them.
    dp.set_plan(plan_from_sizes(None, dp.devices, [20, 0, 0]))
    F.cross_entropy(dp(x), y).backward()
    assert dp.step_times == {}
    dp.train_step(x, y, F.cross_entropy)
    assert dp.step_times == {}


def test_profile_calibrated_scales_observed_devices():
    prof = Profile.from_measurements({"cpu": [(10, 0.1), (100, 1.0)], "cpu@0.25": [(10, 0.4), (100, 4.0)]})
    cal = prof.calibrated({"cpu@0.25": (50, 4.0)})  # observed twice as slow as predicted
    assert cal.step_time("cpu@0.25", 50) == pytest.approx(4.0)
    assert cal.step_time("cpu", 50) == prof.step_time("cpu", 50)
    assert (
        cal.source.endswith("+calibrated") and prof.entry("cpu@0.25").measurements == cal.entry("cpu@0.25").measurements
    )


def test_one_real_device_runs_the_module_itself():
    """As nn.DataParallel does with one device: no replica, the module's own output and buffers."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, ["cpu"])
    x = torch.randn(10, 3, dtype=torch.float64)
    out = dp(x)
    ref_out = ref(x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    assert_same_grads(net, ref, rtol=0, atol=0)
    assert torch.equal(net[1].running_mean, ref[1].running_mean) and int(net[1].num_batches_tracked) == 1
    assert dp._replicator is None and dp.plan.sizes == [10]  # nothing was copied; the plan is still kept


def test_replicas_follow_a_replaced_parameter_and_a_mode_change():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    dp = HeteroDataParallel(net, DEVICES, weights=[1, 1])
    x = torch.randn(6, 3)
    dp(x)  # replicas built and paired with the module's tensors
    net[0].weight = nn.Parameter(torch.eye(3))  # a new tensor, as load_state_dict(assign=True) makes
    net[0].bias = nn.Parameter(torch.zeros(3))
    dp.eval()  # and a mode change: dropout off in every replica
    with torch.no_grad():
        assert torch.equal(dp(x), x)


@pytest.mark.parametrize("mode", ["gather", "local"])
@pytest.mark.parametrize(
    "devices, weights",
    [(["cpu", "cpu@0.25"], [3, 1]), (["cpu", "cpu@0.5", "cpu"], [2, 0, 1]), (["cpu", "cpu@0.5", "cpu"], [1, 2, 1])],
)
def test_trainable_layer_in_front_of_the_wrapper(mode, devices, weights):
    """A stem before the wrapper: its graph is walked once, and stem and body get full-batch gradients."""
    torch.manual_seed(0)
    stem, body = nn.Linear(5, 6).double(), nn.Sequential(nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    ref_stem, ref_body = copy.deepcopy(stem), copy.deepcopy(body)
    F.cross_entropy(ref_body(ref_stem(x)), y).backward()
    dp = HeteroDataParallel(body, devices, weights=weights)
    if mode == "gather":
        F.cross_entropy(dp(stem(x)), y).backward()
    else:
        dp.train_step(stem(x), y, F.cross_entropy)
    assert dp.plan.sizes.count(0) == weights.count(0)
    for got, want in ((stem, ref_stem), (body, ref_body)):
        assert_same_grads(got, want, rtol=1e-12, atol=1e-14)


def test_input_gradients_of_a_leaf_and_a_scalar_given_to_every_replica():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, scale):
            return self.lin(x) * scale

    torch.manual_seed(0)
    net = Scaled().double()
    x, scale = torch.randn(9, 4, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64)
    ref_x, ref_s = x.clone().requires_grad_(), scale.clone().requires_grad_()
    copy.deepcopy(net)(ref_x, scale=ref_s).pow(2).sum().backward()
    x.requires_grad_(), scale.requires_grad_()
    HeteroDataParallel(net, DEVICES, weights=[2, 1])(x, scale=scale).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(scale.grad, ref_s.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_a_step_with_one_active_device_runs_the_module_itself(mode):
    """A plan that leaves every other device empty: the module's own step, exactly, on its device."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(net)
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
    F.cross_entropy(ref(x), y).backward()
    dp = HeteroDataParallel(
        net, ["cpu", "cpu@0.25", "cpu"], plan=plan_from_sizes(None, ["cpu", "cpu@0.25", "cpu"], [10, 0, 0])
    )
    if mode == "gather":
        F.cross_entropy(dp(x), y).backward()
    else:
        dp.train_step(x, y, F.cross_entropy)
    assert_same_grads(net, ref, rtol=0, atol=0)
    assert torch.equal(net[1].running_mean, ref[1].running_mean) and int(net[1].num_batches_tracked) == 1
    assert dp._replicator is None and dp.step_times == {}  # no replica, no thread: no busy time measured
    # Only an emulated device active: its replica runs, throttled; gradients still exact.
    dp.set_plan(plan_from_sizes(None, ["cpu", "cpu@0.25", "cpu"], [0, 10, 0]))
    net.zero_grad()
    F.cross_entropy(dp(x), y).backward()
    assert dp._replicator is not None and set(dp.step_times) == {"cpu@0.25"}
    ref.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    assert_same_grads(net, ref, rtol=1e-12, atol=1e-14)


def test_the_calling_thread_runs_the_first_replica_while_a_worker_runs_the_other():
    # With every job in a worker, the second worker started milliseconds late (docs/benchmarks.md).
    seen = {}

    class Where(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            seen[len(x)] = threading.current_thread()
            return self.lin(x)

    dp = HeteroDataParallel(Where(), ["cpu", "cpu"], weights=[3, 1])
    dp(torch.randn(8, 3)).sum().backward()
    assert seen[6] is threading.current_thread() and seen[2] is not threading.current_thread()


def test_the_seams_work_when_called_on_their_own():
    """scatter, replicate, parallel_apply and gather, called as torch's DataParallel recipe calls them."""
    net, (x, y) = _net(), _data(20)
    ref = _reference(net, x, y)
    dp = HeteroDataParallel(copy.deepcopy(net), DEVICES, weights=[3, 1])
    args, kwargs = dp.scatter((x,), {}, dp.devices)
    assert [a[0].shape[0] for a in args] == [15, 5]
    replicas = dp.replicate(dp.module, dp.devices)
    outputs = dp.parallel_apply(replicas, args, kwargs)
    F.cross_entropy(dp.gather(outputs, dp.output_device), y).backward()
    assert max_rel_grad_error(dp.module, ref) < 1e-9
    with pytest.raises(ValueError, match="this wrapper's devices"):
        dp.scatter((x,), {}, ["cpu"])


class _FlagThenFail(nn.Module):
    """Sets a buffer in forward; its backward fails for a shard holding a marked row."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2).double()
        self.register_buffer("seen", torch.tensor(False))

    def forward(self, x):
        self.seen.fill_(True)
        return _FailIfMarked.apply(self.lin(x), x)


class _FailIfMarked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, x):
        ctx.marked = bool((x[:, 0] > 100).any())
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        if ctx.marked:
            raise ValueError("marked row")
        return g, None


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_a_step_that_fails_in_backward_keeps_its_forward_s_buffer_updates(mode):
    """As with the plain module: the forward ran (the buffer is set), the gradients are not kept."""
    x = torch.randn(8, 4, dtype=torch.float64)
    x[-1, 0] = 1000
    net = _FlagThenFail()
    dp = HeteroDataParallel(net, DEVICES, weights=[1, 1])
    with pytest.raises(ValueError, match="marked row"):
        if mode == "gather":
            dp(x).sum().backward()
        else:
            dp.train_step(x, None, lambda out: out.sum(), reduction="sum")
    assert bool(net.seen) and all(p.grad is None for p in net.parameters())


# -- what the plain module does that replicas could not (issue 36) -------------------------------


class _WritesInput(nn.Module):
    """Writes into its input in place: ``x.div_(255)`` or ``nn.ReLU(inplace=True)`` on the input."""

    def __init__(self, how):
        super().__init__()
        self.how, self.act = how, nn.ReLU(inplace=True)
        self.lin, self.out = nn.Linear(6, 8).double(), nn.Linear(8, 3).double()

    def forward(self, x):
        x = x.div_(255) if self.how == "div" else self.act(x)
        return self.out(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("how", ["div", "relu"])
@pytest.mark.parametrize("mode", ["gather", "local"])
def test_a_forward_that_writes_into_its_input_equals_the_plain_module(mode, how):
    """Each replica's shard has its own version counter: no 'modified by an inplace operation' (6 of 10 steps)."""
    torch.manual_seed(0)
    net = _WritesInput(how)
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[3, 1])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    for step in range(4):
        x, y = batch(24, (6,), classes=3, seed=step)
        x = x * 100
        xs, xr = x.clone(), x.clone()
        for o in opts:
            o.zero_grad()
        if mode == "gather":
            F.cross_entropy(dp(xs), y).backward()
        else:
            dp.train_step(xs, y, F.cross_entropy)
        F.cross_entropy(ref(xr), y).backward()
        assert_same_grads(net, ref, f"step {step}: ")
        assert torch.equal(xs, xr)  # the caller's batch written in place, as by the plain module
        for o in opts:
            o.step()


def test_an_input_write_with_micro_batches_recomputed_in_backward_is_refused():
    """Gather mode recomputes a capped device's micro-batches from their inputs: a write there is refused."""
    net = _WritesInput("div")
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, ["cpu", "cpu:max4"], plan=plan_from_sizes(None, ["cpu", "cpu:max4"], [4, 8]))
    x, y = batch(12, (6,), classes=3)
    with pytest.raises(RuntimeError, match="writes into its input in place.*train_step"):
        dp(x.clone())
    dp.train_step(x.clone(), y, F.cross_entropy)  # local-loss mode recomputes nothing: exact
    F.cross_entropy(ref(x.clone()), y).backward()
    assert_same_grads(net, ref)


def _counting_backend(runs):
    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    return backend


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_compiled_model_trains_compiled_and_exactly(how):
    """Each replica runs the module's compilation on its own parameters (was: refused in backward)."""
    torch._dynamo.reset()
    net, (x, y) = _net(), _data(24)
    ref = copy.deepcopy(net)
    runs = []
    if how == "torch.compile":
        model = torch.compile(net, backend=_counting_backend(runs))
    else:
        net.compile(backend=_counting_backend(runs))
        model = net
    dp = HeteroDataParallel(model, DEVICES, weights=[3, 1])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    for step in range(3):
        xs, ys = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
        for o in opts:
            o.zero_grad()
        before = len(runs)
        F.cross_entropy(dp(xs), ys).backward()
        assert len(runs) - before == 2  # both replicas ran compiled code
        F.cross_entropy(ref(xs), ys).backward()
        assert_same_grads(net, ref, f"step {step}: ")
        for o in opts:
            o.step()


class _ZeroesBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x):
        nn.init.zeros_(self.lin.bias)  # a reset in forward
        return self.lin(x)


class _ActNorm(nn.Module):
    """ActNorm-style data-dependent initialisation: the first forward sets ``loc`` from its batch."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(6, dtype=torch.float64))
        self.register_buffer("ready", torch.tensor(False))
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x):
        if not self.ready:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.ready.fill_(True)
        return self.lin(x + self.loc)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_a_forward_that_writes_into_a_parameter_is_refused_naming_it(mode):
    dp = HeteroDataParallel(_ZeroesBias(), DEVICES, weights=[3, 1])
    x, y = batch(12, (6,), classes=3)
    with pytest.raises(RuntimeError, match="wrote into its parameter 'lin.bias'.*dp.module"):
        _step(dp, x, y, mode)
    assert all(p.grad is None for p in dp.parameters())


def test_data_dependent_initialisation_runs_on_the_module_then_training_is_exact():
    """ActNorm: refused through the wrapper; initialised on dp.module as the message says, the steps are exact."""
    torch.manual_seed(0)
    net = _ActNorm()
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1])
    x, y = batch(24, (6,), classes=3)
    with pytest.raises(RuntimeError, match="wrote into its parameter 'loc'"):
        dp(x)
    assert not net.ready  # the refused step merged nothing
    with torch.no_grad():
        dp.module(x)  # the first forward, on the module itself
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    for _ in range(3):
        for o in opts:
            o.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        F.cross_entropy(ref(x), y).backward()  # its first forward initialises from the same batch
        assert_same_grads(net, ref)
        for o in opts:
            o.step()


def test_a_lazy_model_is_refused_at_wrapping_until_called_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(3)).double()
    x, y = batch(12, (6,), classes=3)
    with pytest.raises(ValueError, match=r"uninitialized \(lazy\) parameters.*call the model once on one sample"):
        HeteroDataParallel(net, DEVICES, weights=[3, 1])
    net(x[:1])
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1])
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert_same_grads(net, ref)


class _SumLoss(nn.Module):
    """A model that computes its loss itself, summed over the batch."""

    def __init__(self, how):
        super().__init__()
        self.how, self.lin = how, nn.Linear(6, 3).double()

    def forward(self, x, y):
        out = self.lin(x)
        return F.cross_entropy(out, y, reduction="sum") if self.how == "loss" else out.pow(2).sum()


@pytest.mark.parametrize("how", ["loss", "sum"])
def test_a_scalar_summed_over_the_batch_is_refused_by_default_and_exact_with_sum(how):
    torch.manual_seed(0)
    net = _SumLoss(how)
    ref = copy.deepcopy(net)
    x, y = batch(24, (6,), classes=3)
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1])
    with pytest.raises(ValueError, match="sum over each replica's shard.*scalar_outputs='sum'"):
        dp(x, y)
    dp.scalar_outputs = "sum"
    loss, loss_ref = dp(x, y), ref(x, y)
    assert_close(loss, loss_ref, "loss")  # 30.1, not the shard-weighted 19.7
    loss.backward()
    loss_ref.backward()
    assert_same_grads(net, ref)


def test_a_summed_loss_in_local_mode_is_refused_by_default_and_exact_with_sum():
    net, (x, y) = _net(), _data(24)
    ref = copy.deepcopy(net)
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1])
    summed = lambda out, t: F.cross_entropy(out, t, reduction="sum")
    with pytest.raises(ValueError, match="sum over each replica's shard.*reduction='sum'"):
        dp.train_step(x, y, summed)
    assert all(p.grad is None for p in net.parameters())
    loss = dp.train_step(x, y, summed, reduction="sum")
    loss_ref = summed(ref(x), y)
    loss_ref.backward()
    assert_close(loss, loss_ref.detach(), "loss")
    assert_same_grads(net, ref)


class _TokenLoss(nn.Module):
    """A token model computing its own mean loss over labelled (non -100) tokens, as Hugging Face's do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(7, 5).double(), nn.Linear(5, 7).double()

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("mode", ["gather", "local"])
def test_count_tokens_with_a_shard_without_labelled_tokens_reports_the_plain_loss(mode):
    """The shard weighted 0 adds nothing to the loss (was: nan), and nothing to the gradients."""
    net = _TokenLoss()
    ref = copy.deepcopy(net)
    ids = torch.randint(0, 7, (8, 5), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[6:] = -100  # the last shard (2 rows) holds no labelled token
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1], scalar_outputs=hetsplit.count_tokens("labels", shift=False))
    if mode == "gather":
        loss = dp(input_ids=ids, labels=labels)
        loss.backward()
    else:
        weigh = hetsplit.count_tokens("labels", shift=False)
        loss = dp.train_step({"input_ids": ids, "labels": labels}, None, lambda out: out, reduction=weigh)
    loss_ref = ref(ids, labels)
    loss_ref.backward()
    assert torch.isfinite(loss) and dp.plan.sizes == [6, 2]
    assert_close(loss.detach(), loss_ref.detach(), "loss")
    assert_same_grads(net, ref)


def _files_entered(work):
    """The hetsplit/ files whose Python functions run during ``work()`` (sys.setprofile).

    The calling thread runs the first replica's work itself, so it enters every file a
    worker thread does (threads started meanwhile are traced too; the persistent workers,
    started at an earlier step, are not).

    Left out: ``_torch.py`` and ``tree.py``, the door to torch's internals and the walk of
    nested batches that every layer calls, as issue 45 counted (12 files before, 16 at a new
    batch size; 14 and 18 with those two).
    """
    root = os.path.dirname(hetsplit.__file__)
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, root))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen - {"_torch.py", "tree.py"})


def test_a_step_enters_few_files():
    # Per-step questions (the plan of this batch size, the pay check once settled, the
    # devices' names, a real device's throttle and memory check) are answered once, not at
    # every step: a step enters only the files that do its work.
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    dp = HeteroDataParallel(net, ["cpu", "cpu"], weights=[2, 1])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(n):
        x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
        opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        opt.step()

    for _ in range(8):  # past the pay check's steps of this plan
        step(12)
    steady = _files_entered(lambda: step(12))
    assert len(steady) <= 10, steady
    # A new batch size adds the making of its plan (and the pay check, which times its steps).
    again = _files_entered(lambda: step(9))
    added = [f for f in again if f not in steady and not f.startswith("planning/")]
    assert set(added) <= {"parallel/sizes.py", "parallel/paying.py"}, added
    # The guide's walk of this step is checked against a traced step in tests/test_layout.py.
