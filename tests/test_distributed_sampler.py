"""HeteroDistributedSampler in one process (rank and world given explicitly): one list of indices per step."""

import pytest

from hetsplit.distributed import HeteroDistributedSampler
from hetsplit.planning import plan_from_sizes

PLAN = plan_from_sizes(None, ["rank0", "rank1", "rank2"], [6, 3, 1])


def _flat(sampler):
    """A rank's indices over the epoch, in order (the steps' lists joined)."""
    return [i for step in sampler for i in step]


def _all(n, **kw):
    return [_flat(HeteroDistributedSampler(list(range(n)), PLAN, num_replicas=3, rank=r, **kw)) for r in range(3)]


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
    assert _flat(a) == _flat(b)
    b.set_epoch(1)
    assert _flat(a) != _flat(b) and sorted(_flat(b)) != _flat(b)
    c = HeteroDistributedSampler(list(range(50)), PLAN, num_replicas=3, rank=0, seed=8)
    assert _flat(a) != _flat(c)


def test_zero_share_rank_has_steps_but_no_samples():
    plan = plan_from_sizes(None, ["rank0", "rank1"], [10, 0])
    s = HeteroDistributedSampler(list(range(25)), plan, num_replicas=2, rank=1, zero_share="empty")
    assert _flat(s) == [] and list(s) == [[], [], []] and len(s) == s.steps == 3


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"num_replicas": 2, "rank": 0}, "3 shares for 2 ranks"),
        ({"num_replicas": 3, "rank": 3}, "rank 3 is out of range"),
    ],
)
def test_bad_arguments(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        HeteroDistributedSampler(list(range(10)), PLAN, **kw)


# -- plan changes, zero shares, the last global batch ------------------------------------------


def _batch_samplers(n, plan=PLAN, **kw):
    return [HeteroDistributedSampler(list(range(n)), plan, num_replicas=3, rank=r, **kw) for r in range(3)]


def test_batch_sampler_follows_a_plan_change_from_the_scheduled_step():
    samplers = _batch_samplers(47, seed=2)
    new = plan_from_sizes(None, ["rank0", "rank1", "rank2"], [2, 3, 5])
    iters = [iter(s) for s in samplers]
    steps = [[next(it) for it in iters] for _ in range(2)]
    for s in samplers:
        s.set_plan(new, 2)
    steps += [list(group) for group in zip(*iters)]
    assert [[len(b) for b in step] for step in steps] == [[6, 3, 1]] * 2 + [[2, 3, 5]] * 3
    flat = [i for step in steps for b in step for i in b]
    assert set(flat) == set(range(47)) and len(flat) == 50  # still disjoint, covering, padded as before
    per_rank = [list(s) for s in samplers]  # the next epoch, same seed: the new plan throughout
    assert [len(b) for b in per_rank[2]] == [5] * 5 and samplers[0].yielded == 10


def test_batch_sampler_checks_plan_changes():
    batched = _batch_samplers(30, seed=4)
    with pytest.raises(ValueError, match="global batch is 10"):
        batched[0].set_plan(plan_from_sizes(None, ["a", "b", "c"], [6, 3, 2]), 5)
    next(iter(batched[0]))
    with pytest.raises(ValueError, match="already been handed out"):
        batched[0].set_plan(PLAN, 0)


def test_batch_sampler_collates_an_empty_share_to_empty_tensors():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(20, 3), torch.arange(20))
    plan = plan_from_sizes(None, ["rank0", "rank1"], [10, 0])
    sampler = HeteroDistributedSampler(data, plan, num_replicas=2, rank=1, zero_share="empty")
    x, y = next(iter(DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate)))
    assert x.shape == (0, 3) and y.shape == (0,) and y.dtype == torch.int64


def test_a_zero_share_is_served_two_real_samples_that_count_as_none():
    plan = plan_from_sizes(None, ["rank0", "rank1"], [8, 0])
    sampler = HeteroDistributedSampler(list(range(20)), plan, num_replicas=2, rank=1, shuffle=False)
    # The first two samples of each global batch (BatchNorm cannot train on one); the last
    # global batch, wrapped around to 8 (pad=True), has them too.
    assert list(sampler) == [[0, 1], [8, 9], [16, 17]]
    assert [sampler.real_rows(k) for k in range(3)] == [0, 0, 0] and sampler.is_filler(0)
    with pytest.raises(ValueError, match="zero_share='none'"):
        HeteroDistributedSampler(list(range(20)), plan, num_replicas=2, rank=1, zero_share="none")


def test_unpadded_last_global_batch_is_cut_in_proportion_every_sample_once():
    plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    cut = [
        HeteroDistributedSampler(list(range(21)), plan, num_replicas=2, rank=r, shuffle=False, pad=False)
        for r in (0, 1)
    ]
    batches = [list(s) for s in cut]
    assert [len(b) for b in batches[0]] == [6, 6, 4] and [len(b) for b in batches[1]] == [2, 2, 1]
    assert sorted(i for b in batches for step in b for i in step) == list(range(21))
    padded = HeteroDistributedSampler(list(range(21)), plan, num_replicas=2, rank=1, shuffle=False)
    assert list(padded)[-1] == [1, 2] and padded.real_rows(2) == 0  # wrap-around padding counts as none


def test_every_rank_knows_which_global_batch_is_padded_even_where_its_own_rows_are_not():
    # Under FSDP2 a forward is collective: a rank with no padding of its own must still know that
    # another rank's rows pad the batch (and runs the same number of forwards as it).
    plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    for rank in (0, 1):
        s = HeteroDistributedSampler(list(range(19)), plan, num_replicas=2, rank=rank, shuffle=False)
        assert [s.padded(k) for k in range(3)] == [False, False, True], rank  # 16..18 real, then 5 wrapped
    assert HeteroDistributedSampler(list(range(19)), plan, num_replicas=2, rank=0, shuffle=False).real_rows(2) == 3
    assert not any(
        HeteroDistributedSampler(list(range(19)), plan, num_replicas=2, rank=0, pad=False).padded(k) for k in (2,)
    )
    assert not HeteroDistributedSampler(list(range(16)), plan, num_replicas=2, rank=0).padded(1)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"method": "outputs"}, 'method="outputs" needs the plan'),
        ({"method": "buckets"}, "unknown method 'buckets'; use one of hook, outputs"),
        ({"reduction": "max"}, "max"),
    ],
)
def test_weight_gradients_rejects_bad_arguments_before_any_collective(kw, fragment):
    # No process group exists here: the arguments are refused before anything distributed runs.
    from hetsplit.distributed import weight_gradients

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        weight_gradients(object(), None, **kw)


def test_plan_rejects_a_negative_calibration_before_any_collective():
    from hetsplit.distributed import plan

    with pytest.raises(ValueError, match="calibrate must be a number of steps >= 0, got -1"):
        plan(None, None, 8, calibrate=-1)
    for bad in (-1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match=f"calibrate_seconds must be a number of seconds >= 0, got {bad!r}"):
            plan(None, None, 8, calibrate_seconds=bad)


def test_calibration_correction_passes_the_curve_through_the_measurement():
    from hetsplit.distributed.calibrate import _through
    from hetsplit.planning.curve import Curve

    c = Curve.fit([(4, 0.02), (16, 0.05), (64, 0.2)])
    slower, faster = _through(c, 16, 0.06), _through(c, 16, 0.04)
    assert slower(16) == pytest.approx(0.06) and faster(16) == pytest.approx(0.04)
    assert slower(64) - c(64) == pytest.approx(0.01)  # more work: a fixed overhead, same slope
    assert faster(64) / c(64) == pytest.approx(0.8)  # less work: scaled down
    assert _through(c, 16, float("nan")) is c


def test_an_iterable_dataset_is_one_line_naming_what_works():
    import torch

    import hetsplit.distributed as hd

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(4)

    with pytest.raises(ValueError) as info:
        hd.data_loader(Stream(), PLAN, num_replicas=3, rank=0)
    message = str(info.value)
    assert "Stream is an iterable dataset" in message and "map-style dataset" in message, message
    assert "hd.local_batch(batch, plan)" in message and "\n" not in message


def test_local_batch_cuts_nests_and_serves_a_zero_share_the_loader_s_stand_in():
    import torch
    from transformers import BatchEncoding

    import hetsplit.distributed as hd

    zero = plan_from_sizes(None, ["rank0", "rank1", "rank2"], [7, 3, 0])
    batch = BatchEncoding({"ids": torch.arange(10), "mask": torch.ones(10, 2), "tag": "x"})
    parts = [hd.local_batch(batch, zero, rank=r) for r in range(3)]
    assert all(type(p) is BatchEncoding and p["tag"] == "x" and len(p["mask"]) == len(p["ids"]) for p in parts)
    assert [p["ids"].tolist() for p in parts] == [list(range(7)), [7, 8, 9], [0, 1]]  # rank 2: the stand-in
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    (served,) = next(iter(hd.data_loader(dataset, zero, shuffle=False, num_replicas=3, rank=2)))
    assert served.tolist() == [0, 1]  # what hd.data_loader serves it


def short_last_batch(ctx):
    # data_loader(pad=False) with the plan's weighting: 15 samples in global batches of 8, so
    # the last holds 7, cut [4, 3] by the plan [5, 3]. Rank 1's 3 rows are its planned share,
    # yet weigh 3/7 there, not 3/8: the weighting must take the short batch's sizes from the loader.
    import torch
    import torch.nn.functional as F
    from helpers import max_rel_grad_error, mlp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetsplit.distributed as hd

    plan = plan_from_sizes(None, ["rank0", "rank1"], [5, 3])
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(15, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (15,), generator=gen)
    res = {}
    for method in ("hook", "outputs"):
        ddp = DDP(mlp(6, 5, 3))
        hd.weight_gradients(ddp, plan, method=method)
        loader = hd.data_loader(torch.utils.data.TensorDataset(x, y), plan, shuffle=False, pad=False)
        errors, rows = [], []
        for step, (bx, by) in enumerate(loader):
            ddp.zero_grad()
            F.cross_entropy(ddp(bx), by).backward()
            ref = mlp(6, 5, 3)
            F.cross_entropy(ref(x[8 * step : 8 * step + 8]), y[8 * step : 8 * step + 8]).backward()
            errors.append(max_rel_grad_error(ddp.module, ref))
            rows.append(len(bx))
        res[method] = {"rows": rows, "errors": errors}
    ddp = DDP(mlp(6, 5, 3))  # a script cutting its own global batches: hd.local_batch hands the cut over too
    hd.weight_gradients(ddp, plan)
    F.cross_entropy(ddp(*hd.local_batch((x[8:],), plan)), hd.local_batch(y[8:], plan)).backward()
    ref = mlp(6, 5, 3)
    F.cross_entropy(ref(x[8:]), y[8:]).backward()
    res["local_batch"] = max_rel_grad_error(ddp.module, ref)
    return res


def test_an_unpadded_short_last_batch_trains_exactly_with_the_plan_s_weighting(tmp_path):
    from helpers import run_ranks

    ranks = run_ranks({"short_last_batch": short_last_batch}, tmp_path, world=2)
    for rank, res in enumerate(ranks["short_last_batch"]):
        assert isinstance(res, dict), res  # was: rank 0 refused the last step, advising the sampler it used
        for method in ("hook", "outputs"):
            assert res[method]["rows"] == [[5, 4], [3, 3]][rank], (rank, method, res)
            assert max(res[method]["errors"]) < 1e-12, (rank, method, res)  # float64: rounding only
        assert res["local_batch"] < 1e-12, res
