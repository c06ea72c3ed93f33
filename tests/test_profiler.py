import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetsplit import profile, solve
from hetsplit.profiler import default_ladder, emulation_warning, fingerprint


class Net(nn.Module):
    """Has BatchNorm (running stats), dropout (RNG) and a buffer the profiler must not touch."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, {
        n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }


def test_model_is_left_exactly_as_found():
    torch.manual_seed(0)
    model = Net()
    model(torch.randn(4, 8)).sum().backward()  # existing gradients
    model.eval()
    sample = torch.randn(4, 8)
    state, grads = _snapshot(model)
    rng = torch.get_rng_state()
    profile(model, sample, ["cpu"], batch_sizes=[2, 8], repeats=2, warmup=1, time_budget=5, progress=False)
    state2, grads2 = _snapshot(model)
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert state["bn.num_batches_tracked"] == state2["bn.num_batches_tracked"]
    assert all(torch.equal(grads[k], grads2[k]) for k in grads)
    assert not model.training and next(model.parameters()).device.type == "cpu"
    assert torch.equal(rng, torch.get_rng_state())


def test_profile_records_measurements_and_metadata():
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    p = profile(
        Net(),
        x,
        "cpu,cpu@0.5",
        F.cross_entropy,
        [2, 4, 16],
        target=y,
        repeats=3,
        warmup=1,
        time_budget=10,
        progress=False,
        model_name="net",
    )
    assert p.devices == ["cpu", "cpu@0.5"] and p.emulated == ["cpu@0.5"]
    cpu = p.entry("cpu")
    assert [m.batch for m in cpu.measurements] == [2, 4, 16]
    assert all(len(m.times) == 3 and all(t > 0 for t in m.times) for m in cpu.measurements)
    assert p.model["name"] == "net" and p.model["input_shape"] == [[8]] and p.model["dtype"] == "float32"
    assert p.model["fingerprint"] == fingerprint(Net())
    assert p.entry("cpu@0.5").info.emulated and not cpu.info.emulated
    assert cpu.memory_cap is None  # the CPU is not probed


@pytest.mark.serial  # timings: run alone, not beside the other pytest worker
def test_quarter_speed_cpu_measures_about_a_quarter_throughput():
    torch.set_num_threads(1)
    # Matmul-bound, so the step time is steady on a shared machine (conv steps of the same
    # size vary 3x here from allocation noise).
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    p = profile(
        model,
        torch.randn(8, 512),
        ["cpu", "cpu@0.25"],
        batch_sizes=[64, 128, 256, 512],
        repeats=7,
        warmup=2,
        time_budget=60,
        progress=False,
    )
    # The emulated device runs at a quarter of the CPU's own speed, measured in the same
    # conditions (interleaved passes; a loaded machine slows both, its run-queue wait counted).
    assert p.step_time("cpu@0.25", 512) == pytest.approx(4 * p.step_time("cpu", 512), rel=0.3)
    assert emulation_warning(p) is None
    assert p.throughput("cpu", 512) > p.throughput("cpu@0.25", 512)
    # At 640 samples per-sample cost dominates the fixed cost: mostly on the real CPU.
    plan = solve(p, 640)
    assert 0.05 < plan.shares[1] < 0.4, plan.shares
    assert plan.times[1] == pytest.approx(plan.times[0], rel=0.1)


def test_time_budget_stops_the_ladder_early():
    model = nn.Linear(256, 256)
    p = profile(
        model,
        torch.randn(4, 256),
        ["cpu@0.05"],
        batch_sizes=default_ladder(4096),
        repeats=3,
        warmup=1,
        time_budget=0.3,
        progress=False,
    )
    measured = [m.batch for m in p.entries[0].measurements]
    assert 2 <= len(measured) < len(default_ladder(4096))


def test_dict_inputs_and_default_loss():
    class DictNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, a, b):
            return {"out": self.lin(a) * b}

    sample = {"a": torch.randn(3, 3), "b": torch.randn(3, 1)}
    p = profile(DictNet(), sample, ["cpu"], batch_sizes=[2, 5], repeats=1, warmup=0, progress=False)
    assert [m.batch for m in p.entries[0].measurements] == [2, 5]


def test_a_failing_step_names_device_and_batch():
    with pytest.raises(RuntimeError, match="batch 1 failed on cpu@0.5: ValueError.*BatchNorm needs"):
        profile(Net(), torch.randn(4, 8), ["cpu@0.5"], batch_sizes=[1, 2], progress=False)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"devices": ["cpu", "tpu"]}, "'tpu'"),
        ({"batch_sizes": [0, 4]}, "between 1 and"),
        ({"repeats": 0}, "repeats >= 1"),
        ({"target": torch.zeros(3)}, "target has 3 rows but sample has 4"),
    ],
)
def test_bad_arguments_fail_before_work(kwargs, fragment):
    args = {"devices": ["cpu"], "batch_sizes": [1, 2]} | kwargs
    with pytest.raises(ValueError) as err:
        profile(Net(), torch.randn(4, 8), progress=False, **args)
    assert fragment in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_finds_a_memory_cap():
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))
    p = profile(
        model,
        torch.randn(4, 4096),
        ["cuda:0", "cpu"],
        batch_sizes=[16, 64],
        repeats=2,
        time_budget=60,
        max_probe=1 << 22,
        progress=False,
    )
    gpu = p.entry("cuda:0")
    assert gpu.info.kind == "cuda" and gpu.info.memory_bytes > 0
    assert gpu.memory_probed_to >= 64
    assert torch.cuda.memory_allocated() < 2**30  # memory released after probing


def test_an_emulated_memory_is_probed_like_a_gpu():
    prof = profile(
        nn.Linear(8, 3), torch.randn(4, 8), ["cpu:max100"], batch_sizes=[2, 8, 32], repeats=1, warmup=0,
        time_budget=5, max_probe=512, progress=False,
    )  # fmt: skip
    entry = prof.entries[0]
    # The ladder fits; doubling hits the emulated out-of-memory at 128, bisection finds the cap (to 1/16).
    assert entry.memory_cap is not None and 94 <= entry.memory_cap <= 100 and entry.curve.memory_cap == entry.memory_cap
    assert entry.info.emulated and entry.info.max_batch == 100 and "memory of 100 samples" in entry.info.description
    assert entry.memory is None  # peak memory is measured on CUDA only
    plan = solve(prof, 1000, accumulate=True)
    assert plan.sizes == [1000] and max(plan.micro_batches[0]) <= entry.memory_cap


def test_memory_model_round_trips_and_old_entries_load():
    from hetsplit.planning.records import DeviceProfile, MemoryModel

    model = MemoryModel.fit([(8, 1_000 + 8 * 50), (32, 1_000 + 32 * 50), (64, 1_000 + 64 * 50)])
    assert model.base == pytest.approx(1_000) and model.per_sample == pytest.approx(50)
    assert MemoryModel.from_dict(model.to_dict()) == model
    prof = profile(nn.Linear(8, 3), torch.randn(4, 8), ["cpu"], batch_sizes=[2, 4], repeats=1, warmup=0, progress=False)
    data = prof.entries[0].to_dict()
    assert "memory" not in data  # no key for an unmeasured model: old readers see the same file
    assert DeviceProfile.from_dict({**data, "memory": model.to_dict()}).memory == model
    with pytest.raises(ValueError, match="bytes >= 0"):
        DeviceProfile.from_dict({**data, "memory": {"peaks": [[8, 1]], "base": -1.0, "per_sample": 2.0}})


@settings(max_examples=200, deadline=None)
@given(
    peak=st.integers(1, 2**40),
    batches=st.lists(st.integers(1, 2**16), min_size=2, max_size=6, unique=True),
)
def test_flat_memory_peaks_fit_no_per_sample_bytes_whatever_numpy_rounds(peak, batches):
    # np.polyfit's round-off on flat peaks ((1, 100), (2, 100): 7.35e-15 with numpy 2.4.6) is not
    # a slope: the cap it implied was one sample.
    from hetsplit.planning.records import MemoryModel

    model = MemoryModel.fit([(b, peak) for b in batches])
    assert model.per_sample == 0.0 and model.base == pytest.approx(peak, rel=1e-12)


def test_a_memory_slope_of_whole_bytes_is_kept():
    from hetsplit.planning.records import MemoryModel

    assert MemoryModel.fit([(1, 100), (2, 100)]).per_sample == 0.0
    model = MemoryModel.fit([(1, 10**9), (2, 10**9 + 1), (3, 10**9 + 2)])  # one byte a sample over 10^9
    assert model.per_sample == pytest.approx(1.0)


def test_cpu_devices_are_timed_with_one_thread_as_the_cli_advises():
    torch.set_num_threads(2)
    probe = nn.Linear(3, 2)
    prof = profile(
        probe, torch.zeros(4, 3), ["cpu", "cpu@0.5"], batch_sizes=[2], repeats=1, warmup=0, check_emulation=False
    )
    assert torch.get_num_threads() == 2  # given back
    # each CPU entry records the threads it was timed with
    assert [e.info.threads for e in prof.entries] == [1, 1]
    prof = profile(probe, torch.zeros(4, 3), "cpu", batch_sizes=[2], repeats=1, warmup=0, threads=2)
    assert prof.entry("cpu").info.threads == 2
    with pytest.raises(ValueError, match="threads must be a whole number >= 1 .* got 0"):
        profile(probe, torch.zeros(4, 3), "cpu", threads=0)


def test_a_memory_probe_out_of_time_keeps_the_largest_batch_that_fit():
    # Under load the probe's time can run out before any out-of-memory error: the device
    # must then be planned at what it was seen to hold, never as if its memory had no end.

    from hetsplit.profiler import _probe_cap

    class Runner:  # holds 8 samples, like cpu:max8
        def try_step(self, b, *, probing=False):
            return b <= 8

    assert _probe_cap(Runner(), 4, 4096, time.perf_counter() + 60) == (8, 16)
    assert _probe_cap(Runner(), 4, 4096, time.perf_counter() - 1) == (4, 4)  # out of time at once
    assert _probe_cap(Runner(), 2, 8, time.perf_counter() + 60) == (None, 8)  # fit up to max_probe


def test_an_emulated_device_not_slower_by_its_speed_is_named_in_one_line():
    """A flipped plan on a loaded machine (cpu@0.25 measured barely slower than cpu) is said, not printed."""
    import dataclasses

    from hetsplit.planning.profile import Measurement

    p = profile(Net(), torch.randn(4, 8), ["cpu", "cpu@0.25"], batch_sizes=[2, 4], repeats=1, progress=False)
    real = {m.batch: m.median for m in p.entry("cpu").measurements}

    def emulated_at(ratio):
        slowed = [Measurement(b, [real[b] * ratio]) for b in real]
        entries = [p.entries[0], dataclasses.replace(p.entries[1], measurements=slowed)]
        return dataclasses.replace(p, entries=entries)

    assert emulation_warning(emulated_at(4.2)) is None
    line = emulation_warning(emulated_at(1.4))
    assert line is not None and "\n" not in line
    assert "cpu@0.25 measured 1.4x slower than cpu, not 4x" in line and "weights=" in line
    assert "cpu@0.25 measured 9.0x" in emulation_warning(emulated_at(9.0))
    # Each right alone, but beside each other the scheduler slowed the emulated one's work more
    # (a calibration's factors: measured over profiled time, the devices running together).
    assert emulation_warning(emulated_at(4.0), {"cpu": 0.9, "cpu@0.25": 1.1}) is None  # 4.9x: within 1.3
    line = emulation_warning(emulated_at(4.0), {"cpu": 0.9, "cpu@0.25": 1.5})
    assert line is not None and "cpu@0.25 ran 6.7x slower than cpu beside it, not 4x" in line, line
    # The profile held, so re-profiling is not the advice: the split already follows what it measured.
    assert "follows the speeds measured side by side" in line and "re-profile" not in line
    assert "re-profile on a quieter machine" in emulation_warning(emulated_at(1.4))
    assert "ran 2.7x" in emulation_warning(emulated_at(4.0), {"cpu": 1.5, "cpu@0.25": 1.0})
    assert emulation_warning(emulated_at(4.0), {"cpu@0.25": 3.0}) is None  # the real one not seen: nothing to compare


def test_a_lazy_model_has_a_fingerprint_before_its_first_forward():
    """It crashed ("Can't access the shape of an uninitialized parameter"); once run, the shapes count."""
    lazy = nn.Sequential(nn.LazyLinear(3))
    before = fingerprint(lazy)
    lazy(torch.randn(2, 5))
    assert len(before) == 16 and fingerprint(lazy) != before


def test_garbage_is_collected_only_after_a_step_that_ran_out_of_memory(monkeypatch):
    # A full collection costs tens of milliseconds (hundreds in a process that imported a
    # framework): after every probing step it was most of a small model's profile, far past
    # its time_budget. A step that ran through freed its graph; one that failed may not have.
    import gc

    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    kwargs = dict(batch_sizes=[2, 8, 32], repeats=1, warmup=0, time_budget=5, max_probe=512, progress=False)
    profile(nn.Linear(8, 3), torch.randn(4, 8), ["cpu", "cpu:max1000"], **kwargs)
    assert calls == [], f"{len(calls)} collections in a profile whose every step fit"
    entry = profile(nn.Linear(8, 3), torch.randn(4, 8), ["cpu:max100"], **kwargs).entries[0]
    assert entry.memory_cap is not None and entry.memory_cap <= 100
    # one per out-of-memory step of the probe: at 128, then bisecting between 64 and 128
    assert 1 <= len(calls) <= 5, calls


class _RefusesLargeBatches(nn.Module):
    """Runs up to 16 samples, then fails as a kernel with a batch limit does (not out of memory)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        if x.shape[0] > 16:
            raise RuntimeError("this kernel cannot take more than 16 rows (a stand-in for attention's 65,535)")
        return self.lin(x)


def test_a_batch_refused_while_probing_for_the_cap_is_the_device_s_limit_said_once():
    # On an H200 the memory probe reached 65,536 sequences, which PyTorch's efficient attention refuses;
    # the whole profile failed. Past the ladder, such a refusal marks the largest batch, as memory does.
    with pytest.warns(UserWarning, match=r"cpu:max1000 failed a step of 32 samples while probing") as said:
        p = profile(_RefusesLargeBatches(), torch.randn(4, 8), ["cpu:max1000"], batch_sizes=[2, 4, 8], repeats=1,
                    progress=False)  # fmt: skip
    assert p.entries[0].memory_cap == 16
    assert len([w for w in said if "while probing" in str(w.message)]) == 1
    # Within the ladder the same failure is the user's to see, not a cap.
    with pytest.raises(RuntimeError, match="a training step of batch 32 failed on cpu"):
        profile(_RefusesLargeBatches(), torch.randn(4, 8), ["cpu"], batch_sizes=[8, 32], repeats=1, progress=False)


def test_profile_itself_says_in_one_line_when_an_emulated_device_measured_off_its_speed(monkeypatch):
    """Beside two busy processes cpu@0.25 measured 2.4x slower than cpu, and hetsplit.profile said nothing."""
    import warnings

    import hetsplit.profiler as profiler
    from hetsplit.devices import describe, parse_devices
    from hetsplit.planning.curve import Curve
    from hetsplit.planning.profile import Measurement
    from hetsplit.planning.records import DeviceProfile

    def measured(ratio):
        def fake(model, devs, *args):  # the measurements a loaded machine gave (no clock involved)
            times = {"cpu": 1.0, "cpu@0.25": ratio}
            return [
                DeviceProfile(
                    describe(d),
                    [Measurement(b, [0.001 * b * times[d.name]]) for b in (2, 4)],
                    Curve.fit([(b, 0.001 * b * times[d.name]) for b in (2, 4)]),
                )
                for d in devs
            ]

        return fake

    devices = parse_devices(["cpu", "cpu@0.25"])
    monkeypatch.setattr(profiler, "_measure", measured(2.4))
    with pytest.warns(UserWarning) as caught:
        profile(Net(), torch.randn(4, 8), devices, batch_sizes=[2, 4], repeats=1, progress=False)
    (line,) = [str(w.message) for w in caught]
    assert line.startswith("hetsplit.profile: emulation unreliable here") and "\n" not in line
    assert "cpu@0.25 measured 2.4x slower than cpu, not 4x" in line and "weights=" in line
    monkeypatch.setattr(profiler, "_measure", measured(4.4))  # within the noise allowed (1.3x): nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile(Net(), torch.randn(4, 8), devices, batch_sizes=[2, 4], repeats=1, progress=False)
        monkeypatch.setattr(profiler, "_measure", measured(2.4))  # the caller says it itself
        profile(Net(), torch.randn(4, 8), devices, batch_sizes=[2, 4], repeats=1, progress=False, check_emulation=False)


def test_an_emulated_device_measured_faster_than_declared_is_planned_at_its_declared_speed():
    """cpu@0.25 measured only 2x slower than cpu: planned as 4x (a fifth of the batch), not a third."""
    import dataclasses

    import hetsplit
    from hetsplit.profiler import emulation_faults, held_to_declared_speed

    def measured(slower):
        prof = hetsplit.Profile.from_measurements(
            {"cpu": [(8, 0.01), (32, 0.04)], "cpu@0.25": [(8, 0.01 * slower), (32, 0.04 * slower)]}
        )
        prof.entries[1].info = dataclasses.replace(prof.entries[1].info, emulated=True, speed=0.25)
        return prof

    fast = measured(2.0)
    assert hetsplit.solve(fast, 30).sizes == [20, 10]  # as measured: a third
    assert hetsplit.solve(held_to_declared_speed(fast, emulation_faults(fast)), 30).sizes == [24, 6]  # declared
    slow = measured(8.0)  # slower than declared: its smaller measured share stands
    assert held_to_declared_speed(slow, emulation_faults(slow)) is slow
