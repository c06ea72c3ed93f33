"""The share rules every engine asks planning for: one function each."""

import math
from pathlib import Path

import pytest

from hetsplit.planning.memory import micro_batched
from hetsplit.planning.micro import micro_sizes_within
from hetsplit.planning.plan import Plan, scaled_step
from hetsplit.planning.profile import Profile
from hetsplit.planning.sizes import check_source, with_minimum_shares
from hetsplit.planning.solver import plan_from_sizes


def test_a_share_over_its_cap_becomes_the_fewest_near_equal_micro_batches():
    assert micro_sizes_within(10, 4) == [4, 3, 3]
    assert micro_sizes_within(8, 4) == [4, 4]
    assert micro_sizes_within(3, 4) == [3]
    plan = plan_from_sizes(None, ["a", "b", "c"], [9, 5, 0])
    assert micro_batched(plan, [4, None, 2]).micro_batches == [[3, 3, 3], [5], []]
    assert micro_batched(plan, [4, None, 2]).sizes == [9, 5, 0]  # the shares stay


def test_a_single_sample_share_moves_where_the_room_allows():
    plan = plan_from_sizes(None, ["a", "b", "c"], [9, 1, 4])
    assert with_minimum_shares(plan).sizes == [10, 0, 4]
    assert with_minimum_shares(plan, room=[9, math.inf, math.inf]).sizes == [9, 0, 5]
    assert with_minimum_shares(plan, room={"a": 9}).sizes == [9, 0, 5]  # caps by device name
    even = plan_from_sizes(None, ["a", "b"], [3, 3])
    assert with_minimum_shares(even) is even


def test_a_share_under_the_minimum_sits_out_or_is_raised_whichever_the_profile_finds_faster():
    # Equal devices: [24, 8] (raised) beats [32, 0] (sitting out); "b" 20x slower: the other way.
    import hetsplit

    equal = hetsplit.Profile.from_measurements({"a": [(1, 0.001), (32, 0.032)], "b": [(1, 0.001), (32, 0.032)]})
    raised = with_minimum_shares(plan_from_sizes(equal, ["a", "b"], [26, 6]), 8, profile=equal)
    assert raised.sizes == [24, 8] and raised.notes[0].startswith("b raised from 6 to 8 samples (BatchNorm"), raised
    slow = hetsplit.Profile.from_measurements({"a": [(1, 0.001), (32, 0.032)], "b": [(1, 0.02), (32, 0.64)]})
    out = with_minimum_shares(plan_from_sizes(slow, ["a", "b"], [30, 2]), 8, profile=slow)
    assert out.sizes == [32, 0] and out.notes[0].startswith("b sits out (its 2 samples moved)"), out
    # Without a profile: whichever moves fewer samples.
    assert with_minimum_shares(plan_from_sizes(None, ["a", "b"], [25, 7]), 8).sizes == [24, 8]


@pytest.mark.parametrize("value", ["profile.json", Path("profile.json")])
def test_a_file_name_for_a_source_is_refused_with_the_way_to_load_it(value):
    with pytest.raises(TypeError, match=r"profile must be a hetsplit Profile or Plan, got .*Profile\.load\(path\)"):
        check_source("profile", value, (Profile, Plan))
    check_source("profile", None)  # not given: nothing to check


def test_a_predicted_step_is_each_measured_step_as_long_as_its_slowest_device():
    # Two devices, each the slower one in every other step: their medians are equal (15 ms), but
    # every step took 20 ms plus 1 ms beyond its slowest device's compute.
    steps = [([0.010, 0.020], 0.001), ([0.020, 0.010], 0.001)] * 3
    assert scaled_step(steps, [1.0, 1.0], [0.015, 0.015]) == pytest.approx(0.021)
    # New shares scale each device's compute in every step by its time on the new share over the old.
    assert scaled_step(steps, [2.0, 2.0], [0.030, 0.030]) == pytest.approx(0.041)
    # A device the steps did not time (or whose ratio is unknown) counts at its planned time;
    # one with nothing planned (no share) not at all, however slow it was.
    assert scaled_step([([None, 0.010], 0.001)], [1.0, 1.0], [0.030, 0.015]) == pytest.approx(0.031)
    assert scaled_step([([0.010, 0.010], 0.001)], [None, 1.0], [0.030, 0.015]) == pytest.approx(0.031)
    assert scaled_step([([0.010, 0.500], 0.001)], [1.0, 1.0], [0.010, 0.0]) == pytest.approx(0.011)
    with pytest.raises(ValueError, match="at least one measured step"):
        scaled_step([], [1.0], [0.01])
