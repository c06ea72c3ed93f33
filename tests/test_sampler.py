"""HeteroDistributedSampler in one process (rank and world given explicitly)."""

import pytest

from hetsplit.distributed import HeteroDistributedSampler
from hetsplit.solver import plan_from_sizes

PLAN = plan_from_sizes(None, ["rank0", "rank1", "rank2"], [6, 3, 1])


def _all(n, **kw):
    return [list(HeteroDistributedSampler(list(range(n)), PLAN, num_replicas=3, rank=r, **kw)) for r in range(3)]


def test_shares_per_step_and_disjoint_cover_when_dropping_the_tail():
    parts = _all(47, drop_last=True, seed=1)
    assert [len(p) for p in parts] == [24, 12, 4]  # 4 full global batches of 10
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 40  # disjoint; the last 7 are dropped


def test_no_drop_pads_the_last_global_batch_and_covers_everything():
    parts = _all(47, drop_last=False, seed=1)
    assert [len(p) for p in parts] == [30, 15, 5]  # 5 steps on every rank
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(47)) and len(flat) - len(set(flat)) == 3  # 3 wrapped-around samples


def test_each_step_takes_the_rank_slice_of_the_global_batch():
    parts = _all(30, shuffle=False)
    assert parts[0][:6] == [0, 1, 2, 3, 4, 5] and parts[1][:3] == [6, 7, 8] and parts[2][:1] == [9]
    assert parts[0][6:12] == [10, 11, 12, 13, 14, 15]


def test_deterministic_for_a_seed_and_epoch_changes_the_order():
    a = HeteroDistributedSampler(list(range(50)), PLAN, num_replicas=3, rank=0, seed=7)
    b = HeteroDistributedSampler(list(range(50)), PLAN, num_replicas=3, rank=0, seed=7)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b) and sorted(list(b)) != list(b)
    c = HeteroDistributedSampler(list(range(50)), PLAN, num_replicas=3, rank=0, seed=8)
    assert list(a) != list(c)


def test_zero_share_rank_has_steps_but_no_samples():
    plan = plan_from_sizes(None, ["rank0", "rank1"], [10, 0])
    s = HeteroDistributedSampler(list(range(25)), plan, num_replicas=2, rank=1)
    assert len(s) == 0 and list(s) == [] and s.steps == 3


@pytest.mark.parametrize("kw, fragment", [({"num_replicas": 2, "rank": 0}, "3 shares for 2 ranks"),
                                          ({"num_replicas": 3, "rank": 3}, "rank 3 is out of range")])
def test_bad_arguments(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        HeteroDistributedSampler(list(range(10)), PLAN, **kw)
