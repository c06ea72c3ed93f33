import itertools
import math
import random

import pytest

from hetsplit.planning import Plan, check_sizes, even_sizes, plan_from_sizes, sizes_from_weights, solve
from hetsplit.planning.profile import Profile


def _brute_force(profile, names, batch):
    best = math.inf
    for head in itertools.product(range(batch + 1), repeat=len(names) - 1):
        last = batch - sum(head)
        if last < 0:
            continue
        best = min(best, max(profile.step_time(n, s) for n, s in zip(names, (*head, last))))
    return best


def _random_profile(rng, n):
    meas, caps = {}, {}
    for i in range(n):
        fixed, per = rng.uniform(0, 0.05), rng.uniform(0.001, 0.02)
        sizes = sorted(rng.sample(range(1, 30), rng.randint(1, 4)))
        meas[f"d{i}"] = [(b, fixed + per * b * rng.uniform(0.7, 1.3)) for b in sizes]
        if rng.random() < 0.3:
            caps[f"d{i}"] = rng.randint(0, 15)
    return Profile.from_measurements(meas, caps), caps


def test_solver_is_optimal_against_brute_force():
    rng = random.Random(0)
    checked = 0
    for _ in range(250):
        profile, caps = _random_profile(rng, rng.randint(1, 3))
        batch = rng.randint(1, 24)
        if sum(caps.get(d, 10**9) for d in profile.devices) < batch:
            with pytest.raises(ValueError, match="exceeds what the devices' memory holds"):
                solve(profile, batch)
            continue
        plan = solve(profile, batch)
        assert sum(plan.sizes) == batch and min(plan.sizes) >= 0
        assert plan.step_time == _brute_force(profile, profile.devices, batch)
        checked += 1
    assert checked > 150


def test_proportional_devices_split_80_20():
    p = Profile.from_measurements({"fast": [(100, 0.1)], "slow": [(100, 0.4)]})
    plan = solve(p, 100)
    assert plan.sizes == [80, 20]
    assert plan.speedup_vs_even == pytest.approx(0.2 / 0.08)  # even: slow does 50 in 0.2 s
    assert plan.single_device == "fast" and plan.speedup_vs_single == pytest.approx(1.25)


def test_device_that_only_slows_the_step_gets_zero():
    p = Profile.from_measurements({"gpu": [(1, 0.010), (64, 0.011)], "cpu": [(1, 0.05), (64, 1.0)]})
    plan = solve(p, 64)
    assert plan.sizes == [64, 0] and plan.times[1] == 0.0


def test_memory_cap_is_respected_and_excess_is_reported():
    p = Profile.from_measurements(
        {"big": [(1, 0.1), (10, 1.0)], "small": [(1, 0.001), (10, 0.01)]}, memory_caps={"small": 5}
    )
    assert solve(p, 20).sizes[1] == 5
    p2 = Profile.from_measurements({"a": [(1, 1.0)], "b": [(1, 1.0)]}, memory_caps={"a": 3, "b": 4})
    with pytest.raises(ValueError, match=r"batch of 8 exceeds .*\(7: a: 3, b: 4\)"):
        solve(p2, 8)


def test_repeated_devices_and_order():
    p = Profile.from_measurements({"fast": [(100, 0.1)], "slow": [(100, 0.4)]})
    plan = solve(p, 90, devices=["slow", "fast", "fast"])
    assert plan.devices == ["slow", "fast", "fast"] and plan.sizes == [10, 40, 40]


def test_ten_thousand_devices_solve_correctly():
    rng = random.Random(3)
    meas = {
        f"d{i}": [(b, rng.uniform(1e-3, 1e-2) + b * rng.uniform(1e-4, 1e-2)) for b in (1, 16, 256)]
        for i in range(10_000)
    }
    p = Profile.from_measurements(meas)
    plan = solve(p, 500_000)
    assert sum(plan.sizes) == 500_000
    # Optimality certificate: no device could take one more sample and stay under the step
    # time of the device that finishes last, so no move lowers the maximum.
    step = plan.step_time
    names = p.devices
    slowest = max(range(len(names)), key=lambda i: plan.times[i])
    assert all(p.step_time(names[i], plan.sizes[i] + 1) >= step for i in range(0, len(names), 97) if i != slowest)


@pytest.mark.parametrize("batch", [0, -3])
def test_empty_batch_is_rejected(batch):
    p = Profile.from_measurements({"a": [(1, 1.0)]})
    with pytest.raises(ValueError, match=f"got {batch}"):
        solve(p, batch)


def test_weights_use_largest_remainder():
    assert sizes_from_weights(100, [4, 1]) == [80, 20]
    assert sizes_from_weights(10, [1, 1, 1]) == [4, 3, 3]
    assert sizes_from_weights(7, [0, 1]) == [0, 7]
    assert sum(sizes_from_weights(1001, [0.3, 2.7, 1.1])) == 1001


@pytest.mark.parametrize(
    "weights, fragment", [([1, -1], "-1"), ([0, 0], "all be zero"), ([], "empty"), ([1, float("inf")], "inf")]
)
def test_bad_weights_are_named(weights, fragment):
    with pytest.raises(ValueError) as err:
        sizes_from_weights(10, weights)
    assert fragment in str(err.value)


def test_check_sizes_names_the_problem():
    assert check_sizes([3, 0, 2], 5, 3) == [3, 0, 2]
    with pytest.raises(ValueError, match=r"sum to 4, but the batch has 5"):
        check_sizes([2, 2], 5, 2)
    with pytest.raises(ValueError, match="size 1 must be >= 0, got -1"):
        check_sizes([6, -1], 5, 2)
    with pytest.raises(TypeError, match="size 0 must be an integer, got float"):
        check_sizes([2.5, 2.5], 5, 2)
    with pytest.raises(ValueError, match="got 1 sizes"):
        check_sizes([5], 5, 2)


def test_even_sizes():
    assert even_sizes(10, 3) == [4, 3, 3] and even_sizes(2, 4) == [1, 1, 0, 0]


def test_plan_round_trip_and_from_sizes():
    p = Profile.from_measurements({"a": [(10, 0.1)], "b": [(10, 0.4)]}, memory_caps={"b": 3})
    plan = plan_from_sizes(p, ["a", "b"], [6, 4])
    assert plan.times[1] == math.inf and plan.step_time == math.inf
    again = Plan.from_dict(plan.to_dict())
    assert again.sizes == [6, 4] and again.times[1] == math.inf and again.devices == ["a", "b"]
    solved = solve(p, 50)
    assert Plan.from_dict(solved.to_dict()) == solved
