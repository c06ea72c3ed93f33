"""DistributedRebalancer on two gloo ranks: one emulated rank slows down 4x mid-run.

One run for the module (tests/helpers.py's two-rank runner: one thread per rank). Rank 1
runs on ``cpu@1`` (the CPU emulated at full speed) and drops to a quarter speed at
step 12; rank 1 also draws its batches two steps ahead, as a prefetching DataLoader
would, so the ranks' samplers are at different steps when a plan change is decided.
"""

import collections
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import max_rel_grad_error, mlp, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
import hetsplit.distributed as hd
from hetsplit.devices import parse_device
from hetsplit.distributed.sampler import HeteroBatchSampler
from hetsplit.planning import plan_from_sizes

WORLD, BATCH, STEPS, SLOW_AT = 2, 128, 48, 12


def _data():
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(BATCH * 6, 256, dtype=torch.float64, generator=gen),
        torch.randint(0, 4, (BATCH * 6,), generator=gen),
    )


def _net():
    # Enough work per sample (about 1 MFLOP) that a share's time follows its size.
    return mlp(256, 384, 384, 4)


def _batches(loader, ahead):
    """Yield the loader's batches while drawing ``ahead`` batches in advance (a prefetching loader)."""
    queue = collections.deque()
    it = iter(loader)
    for batch in it:
        queue.append(batch)
        if len(queue) > ahead:
            yield queue.popleft()
    yield from queue


def rebalance(ctx):
    """The one scenario: training with the rebalancer while rank 1 slows down."""
    rank = ctx.rank
    device = parse_device("cpu" if rank == 0 else "cpu@1")
    data = _data()
    plan = plan_from_sizes(None, ["rank0:cpu", "rank1:cpu@1"], [BATCH // 2, BATCH // 2])
    sampler = HeteroBatchSampler(data, plan, shuffle=True, seed=3)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate)
    model = DDP(_net())
    grads = hd.weight_gradients(model, plan)
    rb = hd.DistributedRebalancer(
        plan, hetsplit.Rebalancer(every=4), sampler=sampler, gradients=grads, model=model, device=device
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    res = {"sizes": [], "distinct": [], "grad_err": None}
    step, epoch = 0, 0
    try:
        while step < STEPS:
            sampler.set_epoch(epoch)
            for x, y in _batches(loader, ahead=2 if rank == 1 else 0):
                if step == SLOW_AT and rank == 1:
                    device.set_speed(0.25)
                check = bool(rb.history) and step == rb.history[0].step
                before = copy.deepcopy(model.module.state_dict()) if check else None
                with rb.step() as current:
                    shares = list(current.sizes)
                    # A zero share is served two real samples of the global batch, weighted 0.
                    assert len(x) == (shares[rank] or 2), (step, len(x), shares)
                    with device.throttle():
                        loss = F.cross_entropy(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    with device.throttle():
                        loss.backward()
                res["sizes"].append(len(x) if shares[rank] else 0)
                rows = _all_rows(x, y, shares)
                res["distinct"].append(len(torch.unique(rows[0], dim=0)))
                if check:  # the first step on a new plan: the gradient is still the full batch's
                    ref = _net()
                    ref.load_state_dict(before)
                    F.cross_entropy(ref(rows[0]), rows[1]).backward()
                    res["grad_err"] = max_rel_grad_error(model.module, ref)
                opt.step()
                step += 1
                if step >= STEPS:
                    break
            epoch += 1
    finally:
        device.set_speed(None)
    res["history"] = [c.to_dict() for c in rb.history]
    res["final"] = rb.plan.sizes
    res["schedule"] = [(s, p.sizes) for s, p in rb.schedule]
    return res


def _all_rows(x, y, shares):
    """The step's whole global batch (every rank's shard, in rank order; a zero share's stand-in sample left out)."""
    parts = [None] * WORLD
    dist.all_gather_object(parts, (x, y))
    parts = [p for p, share in zip(parts, shares) if share]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks({"rebalance": rebalance}, tmp_path_factory.mktemp("dist_rebalance"), world=WORLD, timeout=60)[
        "rebalance"
    ]


def test_all_ranks_switch_plans_at_the_same_step(ranks):
    assert ranks[0]["history"] == ranks[1]["history"] and ranks[0]["schedule"] == ranks[1]["schedule"]
    changes = ranks[0]["history"]
    assert changes, "the slowed-down rank should have lost samples"
    # This 2-core VM is too noisy to promise no change before the slowdown (the
    # single-process tests check steadiness on seeded noise); after it, rank 1 loses samples.
    assert any(c["step"] > SLOW_AT and c["new_sizes"][1] < c["old_sizes"][1] for c in changes)
    assert ranks[0]["final"][1] < BATCH // 4  # the quarter-speed rank ends with well under half
    assert sum(ranks[0]["final"]) == BATCH


def test_samplers_follow_each_new_plan_from_its_first_step(ranks):
    schedule = ranks[0]["schedule"]
    for step in range(STEPS):
        sizes = [s for start, s in schedule if start <= step][-1]
        assert [ranks[r]["sizes"][step] for r in range(WORLD)] == sizes
        assert ranks[0]["distinct"][step] == BATCH  # disjoint shards making up one whole global batch


def test_gradients_are_exact_on_the_first_step_of_a_new_plan(ranks):
    assert ranks[0]["grad_err"] is not None and ranks[0]["grad_err"] < 1e-9


def test_a_micro_batched_step_is_timed_against_its_micro_batches(tmp_path):
    # One rank is enough to see what the rebalancer is told; its own group, torn down after.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        profile = hetsplit.Profile.from_measurements({"cpu": [(2, 0.002), (8, 0.008)]}, {"cpu": 2})
        plan = hetsplit.solve(profile, 6, accumulate=True)
        assert plan.micro_batches == [[2, 2, 2]]
        seen = []

        class Spy(hetsplit.Rebalancer):
            def record(self, plan, step_times):
                seen.append(plan.micro_batches)
                super().record(plan, step_times)

        rb = hd.DistributedRebalancer(plan, Spy(profile, every=1))
        with rb.step():
            torch.ones(64, 64) @ torch.ones(64, 64)
        # Timed as a batch of 6 (beyond the cap of 2, predicted infinite) it was never counted;
        # and a re-solve without micro-batches would refuse the batch mid-training.
        assert seen == [[[2, 2, 2]]] and "cpu" in rb.rebalancer.factors() and rb.rebalancer.accumulate
        assert rb.plan.micro_batches == [[2, 2, 2]]
        # Without the caps (no profile) a re-solve would hand the rank a whole share: refused.
        with pytest.raises(ValueError, match=r"knows no memory cap .*hetsplit.Rebalancer\(profile\)"):
            hd.DistributedRebalancer(plan, hetsplit.Rebalancer(every=1))
    finally:
        dist.destroy_process_group()
