"""The share rules every engine asks planning for: one function each."""

import math
from pathlib import Path

import pytest

from hetsplit.planning.memory import micro_batched
from hetsplit.planning.micro import micro_sizes_within
from hetsplit.planning.plan import Plan
from hetsplit.planning.profile import Profile
from hetsplit.planning.sizes import check_source, without_single_sample_shares
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
    assert without_single_sample_shares(plan).sizes == [10, 0, 4]
    assert without_single_sample_shares(plan, room=[9, math.inf, math.inf]).sizes == [9, 0, 5]
    assert without_single_sample_shares(plan, room={"a": 9}).sizes == [9, 0, 5]  # caps by device name
    even = plan_from_sizes(None, ["a", "b"], [3, 3])
    assert without_single_sample_shares(even) is even


@pytest.mark.parametrize("value", ["profile.json", Path("profile.json")])
def test_a_file_name_for_a_source_is_refused_with_the_way_to_load_it(value):
    with pytest.raises(TypeError, match=r"profile must be a hetsplit Profile or Plan, got .*Profile\.load\(path\)"):
        check_source("profile", value, (Profile, Plan))
    check_source("profile", None)  # not given: nothing to check
