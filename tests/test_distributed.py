"""hetsplit.distributed on two gloo ranks (file rendezvous in a temp dir, one spawn for the module)."""

import copy
import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetsplit
import hetsplit.distributed as hd
from hetsplit.distributed._group import verify_plan
from hetsplit.planning import plan_from_sizes

WORLD = 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _batch(n=10):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _rel_err(model, ref_grads):
    return max(float((p.grad - g).abs().max() / g.abs().max()) for p, g in zip(model.parameters(), ref_grads))


def _ddp_step(sizes, rank, hook, with_plan=True, method="hook", reduction="mean", user_hook=None):
    x, y = _batch(sum(sizes))
    start = sum(sizes[:rank])
    xs, ys = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
    ddp = DDP(_net())
    if hook:
        plan = plan_from_sizes(None, [f"rank{r}" for r in range(WORLD)], sizes) if with_plan else None
        hd.weight_gradients(ddp, plan, method=method, reduction=reduction)
    if user_hook is not None:
        ddp.register_comm_hook(None, user_hook)
    # mean over the local shard (NaN for an empty one), or a sum
    F.cross_entropy(ddp(xs), ys, reduction=reduction).backward()
    ref = _net()
    F.cross_entropy(ref(x), y, reduction=reduction).backward()
    return _rel_err(ddp.module, [p.grad for p in ref.parameters()])


def _micro_step(sizes, micro, rank, method):
    x, y = _batch(sum(sizes))
    start = sum(sizes[:rank])
    xs, ys = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
    plan = hetsplit.Plan(["a", "b"], sizes, [0.0, 0.0], sum(sizes), micro_batches=micro)
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan, method=method)
    for _ in range(2):  # two steps: the micro-batch count starts over
        ddp.zero_grad()
        for xm, ym in hd.micro_batches(ddp, (xs, ys), plan, device="cpu"):
            F.cross_entropy(ddp(xm), ym).backward()
    ref = _net()
    F.cross_entropy(ref(x), y).backward()
    return _rel_err(ddp.module, [p.grad for p in ref.parameters()])


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30)
    )
    res = {}
    device = "cpu" if rank == 0 else "cpu@0.25"
    x, y = _batch(8)
    plan = hd.plan(
        _net(),
        x,
        40,
        device=device,
        loss_fn=F.cross_entropy,
        target=y,
        batch_sizes=[2, 8, 32],
        repeats=2,
        time_budget=4,
    )
    res["plan"] = plan.to_dict()
    # Calibration: both ranks plan from rank 0's profile of the real CPU, as if equally fast;
    # the DDP steps show rank 1 is emulated at a quarter speed and the plan moves off it.
    prof = [
        hetsplit.profile(
            _net(),
            x,
            ["cpu"],
            F.cross_entropy,
            target=y,
            batch_sizes=[2, 8, 32],
            repeats=3,
            time_budget=3,
            progress=False,
        ).to_dict()
    ]
    dist.broadcast_object_list(prof, src=0)
    prof = hetsplit.Profile.from_dict(prof[0])
    net = _net()
    res["uncalibrated"] = hd.plan(
        net, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=prof, calibrate=0
    ).sizes
    res["calibrated"] = hd.plan(net, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=prof).sizes
    res["model_untouched"] = all(p.grad is None for p in net.parameters()) and all(
        torch.equal(p, q) for p, q in zip(net.parameters(), _net().parameters())
    )

    def failing_loss(out, tgt):
        if rank == 1:
            raise RuntimeError("this loss fails on rank 1")
        return F.cross_entropy(out, tgt)

    try:
        hd.plan(net, x, 40, device=device, loss_fn=failing_loss, target=y, profile=prof)
    except hd.DistributedError as e:
        res["calibration_error"] = str(e)
    res["err_hook"] = _ddp_step([7, 3], rank, hook=True)
    res["err_plain"] = _ddp_step([7, 3], rank, hook=False)
    res["err_zero_rank"] = _ddp_step([10, 0], rank, hook=True)
    res["err_any_size"] = _ddp_step([7, 3], rank, hook=True, with_plan=False)
    res["err_any_size_zero"] = _ddp_step([10, 0], rank, hook=True, with_plan=False)
    res["err_hook_sum"] = _ddp_step([7, 3], rank, hook=True, reduction="sum")
    res["err_outputs"] = _ddp_step([7, 3], rank, hook=True, method="outputs")
    res["err_outputs_zero"] = _ddp_step([10, 0], rank, hook=True, method="outputs")
    res["err_outputs_sum"] = _ddp_step([7, 3], rank, hook=True, method="outputs", reduction="sum")
    # The outputs method leaves the comm hook free: torch's own averaging hook still gives the full batch.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    res["err_outputs_user_hook"] = _ddp_step(
        [7, 3], rank, hook=True, method="outputs", user_hook=default_hooks.allreduce_hook
    )
    # The README's recipe with a rank the plan gives nothing: it still takes part in every step.
    zero_plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 0])
    full_x, full_y = _batch(12)
    loader = hd.data_loader(torch.utils.data.TensorDataset(full_x, full_y), zero_plan, shuffle=False)
    zddp = DDP(_net())
    hd.weight_gradients(zddp, zero_plan)
    shapes = []
    for bx, by in loader:
        shapes.append(len(bx))
        zddp.zero_grad()
        F.cross_entropy(zddp(bx), by).backward()  # the zero share's one real sample: weighted by 0
    zref = _net()
    F.cross_entropy(zref(full_x[6:]), full_y[6:]).backward()  # the last global batch
    res["zero_share_loader"] = {"shapes": shapes, "err": _rel_err(zddp.module, [p.grad for p in zref.parameters()])}
    # A deep copy of the weighted model (an EMA or evaluation copy) runs unweighted, any batch size.
    twin = copy.deepcopy(zddp.module)
    res["copy_runs"] = tuple(twin(full_x[:5]).shape)
    # A plan change (what DistributedRebalancer does): the next step is weighted by the new plan.
    ddp = DDP(_net())
    state = hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]), method="outputs")
    state.set_plan(plan_from_sizes(None, ["a", "b"], [2, 8]))
    xf, yf = _batch(10)
    xs, ys = (xf[:2], yf[:2]) if rank == 0 else (xf[2:], yf[2:])
    F.cross_entropy(ddp(xs), ys).backward()
    ref = _net()
    F.cross_entropy(ref(xf), yf).backward()
    res["err_outputs_new_plan"] = _rel_err(ddp.module, [p.grad for p in ref.parameters()])
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]), method="outputs")
    with torch.no_grad():
        res["outputs_eval_shape"] = list(ddp(_batch(5)[0]).shape)  # evaluation: any size, no check
    try:
        ddp(_batch(5)[0])
    except hd.DistributedError as e:
        res["outputs_method_error"] = str(e)
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]))
    try:
        ddp(_batch(5)[0])  # 5 samples where the plan says 7 or 3
    except hd.DistributedError as e:
        res["plan_method_error"] = str(e)
    res["err_equal_plain"] = _ddp_step([5, 5], rank, hook=False)
    for method in ("hook", "outputs"):  # micro-batches under no_sync, weighted by their samples
        res[f"err_micro_{method}"] = _micro_step([7, 5], [[3, 2, 2], [5]], rank, method)
    res["err_micro_both"] = _micro_step([6, 4], [[3, 3], [2, 1, 1]], rank, "hook")
    sampler = hd.HeteroDistributedSampler(list(range(23)), plan_from_sizes(None, ["a", "b"], [7, 3]), seed=5)
    res["sampler"] = list(sampler)
    res["sampler_steps"] = sampler.steps
    # Mismatched versions: every rank hears of it.
    import hetsplit.distributed.rank_plan as plan_module  # where the version is read

    real = plan_module.__version__
    plan_module.__version__ = real if rank == 0 else "0.0.0-other"
    try:
        hd.plan(_net(), x, 40, device=device)
    except hd.DistributedError as e:
        res["version_error"] = str(e)
    finally:
        plan_module.__version__ = real
    try:
        verify_plan(plan_from_sizes(None, ["a", "b"], [5, 5] if rank == 0 else [6, 4]))
    except hd.DistributedError as e:
        res["plan_error"] = str(e)
    # A rank that hangs: the other stops with a clear error once the group's timeout ends.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        start = time.perf_counter()
        try:
            verify_plan(plan, group=short)
        except hd.DistributedError as e:
            res["timeout_error"] = str(e)
        res["timeout_after"] = time.perf_counter() - start
    else:
        time.sleep(6)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    # Both ranks done before the groups go: left to interpreter exit, gloo's threads can
    # abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_all_ranks_agree_on_the_plan(ranks):
    plans = [r["plan"] for r in ranks]
    assert plans[0] == plans[1]
    assert plans[0]["devices"] == ["rank0:cpu", "rank1:cpu@0.25"] and sum(plans[0]["sizes"]) == 40
    assert plans[0]["sizes"][0] > plans[0]["sizes"][1]  # the quarter-speed rank gets less
    assert plans[0]["emulated"] == ["rank1:cpu@0.25"]


def test_calibration_moves_the_plan_off_a_rank_slower_than_its_profile(ranks):
    for r in ranks:
        assert r["uncalibrated"] == [20, 20]  # the shared profile says the ranks are equally fast
        assert r["calibrated"][0] >= 26, r["calibrated"]  # rank 1 really runs at a quarter speed
        assert r["model_untouched"]
    assert ranks[0]["calibrated"] == ranks[1]["calibrated"]
    for r in ranks:  # a step failing on one rank is reported on every rank, not left hanging in DDP
        assert "failed on ranks {1: 'RuntimeError: this loss fails on rank 1'}" in r["calibration_error"]


def test_weighted_hook_gives_full_batch_gradients(ranks):
    # float64 throughout; the only difference from the reference is summation order.
    assert all(r["err_hook"] < 1e-6 for r in ranks)


def test_micro_batches_under_no_sync_give_full_batch_gradients(ranks):
    for r in ranks:
        assert r["err_micro_hook"] < 1e-9 and r["err_micro_outputs"] < 1e-9 and r["err_micro_both"] < 1e-9


def test_plain_ddp_mean_is_biased_on_uneven_shares(ranks):
    assert all(r["err_plain"] > 1e-2 for r in ranks)  # the bias the hook removes
    assert all(r["err_equal_plain"] < 1e-6 for r in ranks)  # equal shares: the plain mean is right


def test_rank_with_zero_samples_takes_part(ranks):
    assert all(r["err_zero_rank"] < 1e-6 for r in ranks)


def test_every_weighting_path_is_exact_and_off_plan_steps_are_refused(ranks):
    for key in (
        "err_any_size",
        "err_any_size_zero",
        "err_hook_sum",
        "err_outputs",
        "err_outputs_zero",
        "err_outputs_sum",
        "err_outputs_user_hook",
        "err_outputs_new_plan",
    ):
        assert all(r[key] < 1e-6 for r in ranks), key
    assert "rank 0: this step has 5 samples but the plan gives this rank 7" in ranks[0]["plan_method_error"]
    assert "plan gives this rank 3" in ranks[1]["plan_method_error"]
    assert "rank 1: this step has 5 samples but the plan gives this rank 3" in ranks[1]["outputs_method_error"]
    assert all(r["outputs_eval_shape"] == [5, 3] for r in ranks)


def test_data_loader_serves_a_zero_share_and_copies_run_unweighted(ranks):
    # The rank the plan gives 0 is served one real sample a step, never an empty batch.
    assert ranks[0]["zero_share_loader"]["shapes"] == [6, 6] and ranks[1]["zero_share_loader"]["shapes"] == [1, 1]
    for r in ranks:
        assert r["zero_share_loader"]["err"] < 1e-12  # float64: only rounding
        assert r["copy_runs"] == [5, 3]


def test_sampler_with_process_group_defaults(ranks):
    a, b = ranks[0]["sampler"], ranks[1]["sampler"]
    assert ranks[0]["sampler_steps"] == ranks[1]["sampler_steps"] == 3
    assert len(a) == 21 and len(b) == 9
    assert set(a) | set(b) == set(range(23))


def test_mismatches_are_reported_on_every_rank(ranks):
    assert all("hetsplit versions differ" in r["version_error"] for r in ranks)
    assert all("ranks [1] hold a different plan" in r["plan_error"] for r in ranks)


def test_a_hung_rank_becomes_a_clear_error(ranks):
    assert ranks[0]["timeout_error"].startswith(
        "rank 0: comparing plans failed: rank 1 did not answer within the 3 s timeout: it hangs"
    )
    assert "\n" not in ranks[0]["timeout_error"]
    assert ranks[0]["timeout_after"] < 15
