import itertools
import math
import random

import numpy as np
import pytest

from hetsplit.devices import DeviceInfo
from hetsplit.planning import Plan, plan_from_sizes, solve
from hetsplit.planning.curve import Curve
from hetsplit.planning.plan import check_sizes, even_sizes, sizes_from_weights
from hetsplit.planning.profile import Profile
from hetsplit.planning.records import DeviceProfile
from hetsplit.planning.sizes import resolve_plan
from hetsplit.planning.solver import solve_lockstep


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


def _micro_time(curve, b):
    """Brute force: the best near-equal micro-batching of ``b`` samples under the curve's cap."""
    if b == 0:
        return 0.0
    cap = curve.memory_cap
    if cap is None:
        return curve(b)
    if cap == 0:
        return math.inf
    best = math.inf
    for k in range(-(-b // cap), b + 1):
        q, r = divmod(b, k)
        best = min(best, (r * curve(q + 1) if r else 0.0) + (k - r) * curve(q))
    return best


def _convex_profile(rng, n):
    meas, caps = {}, {}
    for i in range(n):
        fixed, per, power = rng.uniform(0, 0.05), rng.uniform(0.001, 0.02), rng.choice([0.7, 1.0, 1.6])
        sizes = sorted(rng.sample(range(1, 30), rng.randint(1, 4)))
        meas[f"d{i}"] = [(b, fixed + per * b**power * rng.uniform(0.8, 1.2)) for b in sizes]
        if rng.random() < 0.7:
            caps[f"d{i}"] = rng.randint(0, 9)
    return Profile.from_measurements(meas, caps)


def test_accumulate_is_optimal_against_brute_force():
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        profile = _convex_profile(rng, rng.randint(1, 3))
        names, batch = profile.devices, rng.randint(1, 20)
        curves = [profile.curve(n) for n in names]
        if all(c.memory_cap == 0 for c in curves):
            with pytest.raises(ValueError, match="at least one sample"):
                solve(profile, batch, accumulate=True)
            continue
        plan = solve(profile, batch, accumulate=True)
        best = math.inf
        for head in itertools.product(range(batch + 1), repeat=len(names) - 1):
            if sum(head) <= batch:
                sizes = (*head, batch - sum(head))
                best = min(best, max(_micro_time(c, s) for c, s in zip(curves, sizes)))
        assert plan.step_time == pytest.approx(best, rel=1e-9, abs=1e-15)
        for c, size, micro, t in zip(curves, plan.sizes, plan.micro_batches, plan.times):
            assert sum(micro) == size and max(micro, default=0) - min(micro, default=0) <= 1
            assert c.memory_cap is None or max(micro, default=0) <= c.memory_cap
            assert sum(c(m) for m in micro) == pytest.approx(t, rel=1e-9) and t == pytest.approx(_micro_time(c, size))
        checked += 1
    assert checked > 250


def test_accumulate_runs_a_batch_larger_than_every_cap():
    p = Profile.from_measurements({"a": [(16, 0.016), (64, 0.064)], "b": [(16, 0.064), (64, 0.256)]}, {"a": 64})
    assert solve(p, 512).sizes == [64, 448]  # today's cap-limited plan
    plan = solve(p, 512, accumulate=True)
    assert plan.sizes == [410, 102] and plan.micro_batches == [[59, 59, 59, 59, 58, 58, 58], [102]]
    assert Plan.from_dict(plan.to_dict()) == plan
    old = plan.to_dict()
    del old["micro_batches"]  # a plan saved before micro-batches: one batch per device
    assert Plan.from_dict(old).micro_batches == [[410], [102]]
    capped = Profile.from_measurements({"a": [(16, 0.016)], "b": [(16, 0.064)]}, {"a": 8, "b": 8})
    with pytest.raises(ValueError, match="accumulate=True"):
        solve(capped, 100)
    assert solve(capped, 100, accumulate=True).sizes == [80, 20]
    uncapped = Profile.from_measurements({"a": [(16, 0.02), (64, 0.05)]})
    assert solve(uncapped, 500, accumulate=True).micro_batches == [[500]]  # no cap: one micro-batch


def test_accumulate_many_devices_matches_capacity():
    rng = random.Random(3)
    meas = {
        f"d{i}": [(b, rng.uniform(1e-3, 1e-2) + b * rng.uniform(1e-4, 1e-2)) for b in (1, 4, 16, 64)]
        for i in range(300)
    }
    caps = {f"d{i}": rng.randint(1, 40) for i in range(0, 300, 2)}
    profile = Profile.from_measurements(meas, caps)
    plan = solve(profile, 30_000, accumulate=True)
    # Optimal: one sample more on any device would take at least the step time.
    from hetsplit.planning.solver import micro_table

    engine = micro_table(profile.table(profile.devices))
    more = engine.evaluate([s + 1 for s in plan.sizes])
    assert min(more) >= plan.step_time
    assert max(plan.times) == plan.step_time


def _odd_curve(rng):
    """A curve as merged or quick profiles make them: fractional knots, flat pieces, any intercept and cap."""
    xs = sorted({round(rng.uniform(1, 40), 2) for _ in range(rng.randint(1, 4))})
    if rng.random() < 0.5:
        xs = [float(x) for x in sorted(rng.sample(range(2, 60), len(xs)))]
    ts, t = [], rng.uniform(0.001, 0.05)
    for _ in xs:
        t += rng.choice([0.0, rng.uniform(0, 0.05)])
        ts.append(t)
    cap = rng.choice([None, 0, rng.randint(1, 12), rng.randint(1, 60)])
    return Curve(xs, ts, rng.choice([0.0, ts[0], rng.uniform(0, ts[0])]), rng.uniform(1e-4, 0.01), cap)


def _odd_profile(rng, most):
    """A profile of 1..``most`` odd curves (see :func:`_odd_curve`), and the curves."""
    curves = [_odd_curve(rng) for _ in range(rng.randint(1, most))]
    info = [DeviceInfo(f"d{i}", "cpu", "a test curve") for i in range(len(curves))]
    return Profile([DeviceProfile(d, [], c, c.memory_cap) for d, c in zip(info, curves)]), curves


def test_accumulate_on_fractional_and_flat_curves_matches_brute_force():
    # A micro-batch at the cap next to a fractional knot once made a time NaN (0 x inf).
    from hetsplit.planning.solver import micro_table

    rng = random.Random(5)
    for _ in range(120):
        profile, curves = _odd_profile(rng, 3)
        engine = micro_table(profile.table(profile.devices))
        b = np.arange(30, dtype=float)
        for i, c in enumerate(curves):
            got = engine.evaluate(b, np.full(len(b), i))
            assert got.tolist() == pytest.approx([_micro_time(c, int(x)) for x in b], rel=1e-9, abs=1e-15)
        if all(c.memory_cap == 0 for c in curves):
            continue
        for seconds in (0.01, 0.07, 0.3):
            cap = engine.capacity(seconds)
            assert (engine.evaluate(cap.astype(float)) <= seconds).all()
            assert (engine.evaluate(cap + 1.0) > seconds).all()
        batch = rng.randint(1, 19)
        plan = solve(profile, batch, accumulate=True)
        best = min(
            max(_micro_time(c, s) for c, s in zip(curves, (*head, batch - sum(head))))
            for head in itertools.product(range(batch + 1), repeat=len(curves) - 1)
            if sum(head) <= batch
        )
        assert plan.step_time == pytest.approx(best, rel=1e-9)
        assert [sum(m) for m in plan.micro_batches] == plan.sizes


def test_bounds_bracket_the_exact_capacity_even_at_the_cap_and_knots():
    # The solver's bracket comes from these bounds; at a time equal to t(cap) or a knot's time,
    # give or take an ulp, rounding decides the capacity, and low <= exact <= high must still hold.
    from hetsplit.planning.solver import micro_table

    rng = random.Random(11)
    for _ in range(60):
        profile, curves = _odd_profile(rng, 4)
        table = profile.table(profile.devices)
        for engine in (table, micro_table(table)):
            times = [t for c in curves for t in c.seconds] + [c(c.memory_cap) for c in curves if c.memory_cap]
            for t in times:
                if not math.isfinite(t):
                    continue
                for seconds in (np.nextafter(t, 0), t, np.nextafter(t, 1), 2 * t):
                    low, high = engine.bounds(float(seconds))
                    exact = engine.capacity(float(seconds))
                    assert (low <= exact).all() and (exact <= high).all(), (seconds, low, exact, high)
        # The plan's even and single-device times: the extreme found by pruning equals the full evaluation.
        engine = micro_table(table)
        for _ in range(5):
            b = np.array([float(rng.randint(0, 40)) for _ in curves])
            full = engine.evaluate(b)
            top, i = engine.extreme(b, largest=True)
            least, k = engine.extreme(b, largest=False)
            assert top == full.max() and full[i] == top
            assert least == full.min() and full[k] == least


def test_lockstep_is_optimal_against_brute_force():
    """solve_lockstep (FSDP2: every device runs as many micro-batches) against every k and every split."""
    rng = random.Random(2)
    checked = 0
    for _ in range(150):
        profile = _convex_profile(rng, rng.randint(1, 3))
        names, batch = profile.devices, rng.randint(1, 16)
        curves = [profile.curve(n) for n in names]
        if all(c.memory_cap == 0 for c in curves):
            with pytest.raises(ValueError, match="holds even one sample"):
                solve_lockstep(profile, batch)
            continue
        caps = [c.memory_cap for c in curves if c.memory_cap]
        top = max(1, -(-batch // min(caps))) if caps else 1
        best = math.inf
        for k in range(1, top + 1):
            for head in itertools.product(range(batch + 1), repeat=len(names) - 1):
                if sum(head) <= batch:
                    sizes = (*head, batch - sum(head))
                    best = min(best, max(k * c(s / k) if s else 0.0 for c, s in zip(curves, sizes)))
        plan = solve_lockstep(profile, batch)
        assert plan.step_time == pytest.approx(best, rel=1e-9, abs=1e-15)
        k = max(map(len, plan.micro_batches), default=1)
        # one k for all: a share of k or more runs as k micro-batches, a smaller one sample at a time
        assert all(len(m) == min(s, k) for m, s in zip(plan.micro_batches, plan.sizes))
        for c, size, micro in zip(curves, plan.sizes, plan.micro_batches):
            assert sum(micro) == size
            assert c.memory_cap is None or max(micro, default=0) <= c.memory_cap
        checked += 1
    assert checked > 100


def test_lockstep_prices_the_fast_devices_extra_micro_batches():
    # A capped slow device: per-device accumulation gives it micro-batches and the fast device one
    # batch, which FSDP2 cannot run (the fast rank would have to run as many micro-batches too).
    p = Profile.from_measurements(
        {"fast": [(8, 0.010), (64, 0.040)], "slow": [(2, 0.02), (4, 0.035)]}, memory_caps={"slow": 4}
    )
    apart = solve(p, 128, accumulate=True)
    assert apart.micro_batches == [[120], [4, 4]]
    lockstep = solve_lockstep(p, 128)
    assert lockstep.sizes == [124, 4] and lockstep.micro_batches == [[124], [4]]  # one micro-batch each is fastest
    # Priced as FSDP2 runs it, the per-device plan is slower than the lockstep one.
    as_run = max(2 * p.curve("fast")(120 / 2), 2 * p.curve("slow")(8 / 2))
    assert lockstep.step_time < as_run


@pytest.mark.parametrize("batch, error", [(16.0, TypeError), (True, TypeError), (0, ValueError), (-3, ValueError)])
def test_every_engine_checks_a_batch_size_with_the_one_rule(batch, error):
    # solve() and the sizes policy every engine asks (resolve_plan) refuse alike, in the same words.
    p = Profile.from_measurements({"a": [(1, 1.0)], "b": [(1, 1.0)]})
    with pytest.raises(error) as solved:
        solve(p, batch)
    with pytest.raises(error) as resolved:
        resolve_plan(batch, ["a", "b"], profile=p)
    said = [str(e.value).split(" must ", 1)[1] for e in (solved, resolved)]
    assert said[0] == said[1], said
    if error is ValueError:
        assert "an empty batch has nothing to split" in said[0]
