"""hetsplit.distributed on two gloo ranks: one run of every scenario (tests/helpers.py), one test each.

The ranks are spawned once for the module and run the scenarios below in order; each test
reads its own scenario's result on both ranks, and a scenario that raised names itself and
its traceback in its test. Gradients are compared in float64 against one process running the
whole batch: the only difference is the order of the sums (helpers.RTOL's reasoning), so an
exact path is within 1e-6 (1e-9 for micro-batches) where a biased one is off by >1e-2.
"""

import contextlib
import copy
import dataclasses
import datetime
import functools
import io
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import batch, max_rel_grad_error, mlp, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import hetsplit
import hetsplit.distributed as hd
from hetsplit.distributed._group import verify_plan
from hetsplit.planning import plan_from_sizes
from hetsplit.planning.profile import Profile

_net = functools.partial(mlp, 6, 5, 3)
_batch = functools.partial(batch, shape=(6,), classes=3, seed=3)


def _device(ctx):
    return "cpu" if ctx.rank == 0 else "cpu@0.25"


def _ddp_step(ctx, sizes, hook=True, with_plan=True, method="hook", reduction="mean", user_hook=None):
    x, y = _batch(sum(sizes))
    start = sum(sizes[: ctx.rank])
    xs, ys = x[start : start + sizes[ctx.rank]], y[start : start + sizes[ctx.rank]]
    ddp = DDP(_net())
    if hook:
        plan = plan_from_sizes(None, [f"rank{r}" for r in range(ctx.world)], sizes) if with_plan else None
        hd.weight_gradients(ddp, plan, method=method, reduction=reduction)
    if user_hook == "allreduce":  # torch's own averaging hook
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    # mean over the local shard (NaN for an empty one), or a sum
    F.cross_entropy(ddp(xs), ys, reduction=reduction).backward()
    ref = _net()
    F.cross_entropy(ref(x), y, reduction=reduction).backward()
    return max_rel_grad_error(ddp.module, ref)


def _micro_step(ctx, sizes, micro, method):
    x, y = _batch(sum(sizes))
    start = sum(sizes[: ctx.rank])
    xs, ys = x[start : start + sizes[ctx.rank]], y[start : start + sizes[ctx.rank]]
    if not sizes[ctx.rank]:  # a zero share: two real samples, as hd.data_loader serves it, weighted 0
        xs, ys = x[:2], y[:2]
    plan = hetsplit.Plan(["a", "b"], sizes, [0.0, 0.0], sum(sizes), micro_batches=micro)
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan, method=method)
    for _ in range(2):  # two steps: the micro-batch count starts over
        ddp.zero_grad()
        for xm, ym in hd.micro_batches(ddp, (xs, ys), plan, device="cpu"):
            F.cross_entropy(ddp(xm), ym).backward()
    ref = _net()
    F.cross_entropy(ref(x), y).backward()
    return max_rel_grad_error(ddp.module, ref)


# -- the scenarios, in the order the ranks run them ------------------------------------------


def plan(ctx):
    x, y = _batch(8)
    measured = hd.plan(
        _net(), x, 40, device=_device(ctx), loss_fn=F.cross_entropy, target=y, batch_sizes=[2, 8, 32], repeats=2,
        time_budget=4, calibrate_seconds=0,
    ).to_dict()  # fmt: skip
    # Which way the measured split leans depends on the machine's load (a loaded machine once gave the
    # quarter-speed rank all 40: its emulation no slower than the real CPU, then calibration's fixed
    # overhead on rank 0); the solver's side is checked on profiles the test sets: rank 1 four times slower.
    slow = 4.0 if ctx.rank else 1.0
    given = Profile.from_measurements({_device(ctx): [(2, 0.002 * slow), (32, 0.032 * slow)]})
    with contextlib.redirect_stdout(io.StringIO()) as said:
        solved = hd.plan(_net(), x, 40, device=_device(ctx), profile=given, calibrate=0).to_dict()
        hd.plan(_net(), x, 40, device=_device(ctx), profile=given, calibrate=0, quiet=True)
    # Rank 1's emulated quarter-speed CPU measured only 2x slower than rank 0's real one: the plan
    # carries the note, and an integration's own report of the quietly made plan says it.
    twice = 2.0 if ctx.rank else 1.0
    off = Profile.from_measurements({"cpu": [(2, 0.002 * twice), (32, 0.032 * twice)]})
    off.entries[0].info = dataclasses.replace(off.entries[0].info, name=_device(ctx), emulated=ctx.rank == 1,
                                              speed=0.25 if ctx.rank else 1.0)  # fmt: skip
    flagged = hd.plan(_net(), x, 40, device=_device(ctx), profile=off, calibrate=0, quiet=True)
    with contextlib.redirect_stdout(io.StringIO()) as integration:
        hd.SplitReport("HeteroDDPStrategy", ctx.rank).step(flagged)
    return {"measured": measured, "given": solved, "said": said.getvalue().splitlines(), "notes": flagged.notes,
            "integration": integration.getvalue().splitlines()}  # fmt: skip


def batchnorm_plan(ctx):
    # BatchNorm cannot train on one sample: no rank is handed one (the plain model never meets one).
    x, _ = _batch(8)
    bn = hd.plan(mlp(6, 5, 3, batch_norm=True), x, 8, weights=[7, 1]).sizes
    plain = hd.plan(_net(), x, 8, weights=[7, 1]).sizes
    return {"batchnorm": bn, "plain": plain}


def weighted_caps(ctx):
    # Hand-set weights and an emulated memory (rank 1 holds 2 samples a forward): the share runs as
    # micro-batches with accumulate, and is refused without it, on every rank, before any step.
    x, _ = _batch(8)
    device = ["cpu", "cpu@0.25:max2"][ctx.rank]
    micro = hd.plan(_net(), x, 16, device=device, weights=[1, 1], accumulate=True).micro_batches
    # A BatchNorm model whose weights hand rank 1 a single sample: it moves to rank 0 only within
    # rank 0's memory (15 a forward), or with accumulate as micro-batches that fit it (4 a forward).
    bn = mlp(6, 5, 3, batch_norm=True)
    capped = hd.plan(bn, x, 16, device=["cpu:max15", "cpu"][ctx.rank], weights=[15, 1])
    moved = hd.plan(bn, x, 16, device=["cpu:max4", "cpu"][ctx.rank], weights=[15, 1], accumulate=True)
    named = hd.plan(_net(), x, 16, device=device, weights=[1, 1], accumulate=True, quiet=True).devices
    out = {"micro": micro, "capped": capped.sizes, "moved": [moved.sizes, moved.micro_batches], "named": named}
    try:
        hd.plan(_net(), x, 16, device=device, weights=[1, 1])
    except ValueError as e:
        return {**out, "error": str(e)}
    return {**out, "error": None}


def zero_share_calibration(ctx):
    # Rank 1 profiled 1000x slower gets 0 of 40: it still calibrates, on the two stand-in samples it
    # runs in training, and its curve then passes through that step (uncalibrated, its stand-in step
    # under DDP's all-reduce ran 1.4-2x its profile: ResNet-18 on cpu@0.25).
    import hetsplit.distributed.rank_plan as rank_plan

    ran, real = [], rank_plan.calibration_steps

    def spy(*args, **kwargs):
        ran.append(args[5].sizes)  # the plan calibrated
        return real(*args, **kwargs)

    x, y = _batch(8)
    slow = 1000.0 if ctx.rank else 1.0
    given = Profile.from_measurements({_device(ctx): [(2, 0.002 * slow), (32, 0.032 * slow)]})
    rank_plan.calibration_steps = spy
    try:
        # A BatchNorm model: no share under 8 samples, so the stand-ins are not made a share of 2.
        planned = hd.plan(mlp(6, 5, 3, batch_norm=True), x, 40, device=_device(ctx), loss_fn=F.cross_entropy,
                          target=y, profile=given, calibrate=2, calibrate_seconds=0, quiet=True)  # fmt: skip
    finally:
        rank_plan.calibration_steps = real
    return {"sizes": planned.sizes, "calibrated": ran, "stand_in_time": planned.times[1]}


def calibration(ctx):
    # Both ranks plan from rank 0's profile of the real CPU, as if equally fast; the DDP steps
    # show rank 1 is emulated at a quarter speed and the plan moves off it.
    x, y = _batch(8)
    prof = [
        hetsplit.profile(
            _net(), x, ["cpu"], F.cross_entropy, target=y, batch_sizes=[2, 8, 32], repeats=3, time_budget=3,
            progress=False,
        ).to_dict()
    ]  # fmt: skip
    dist.broadcast_object_list(prof, src=0)
    ctx.profile = hetsplit.Profile.from_dict(prof[0])
    net, device = _net(), _device(ctx)
    res = {
        "uncalibrated": hd.plan(
            net, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=ctx.profile, calibrate=0
        ).sizes,
        "calibrated": hd.plan(
            net, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=ctx.profile, calibrate_seconds=0
        ).sizes,
    }
    res["model_untouched"] = all(p.grad is None for p in net.parameters()) and all(
        torch.equal(p, q) for p, q in zip(net.parameters(), _net().parameters())
    )
    # The calibration's DDP steps are the steps training runs: with the shard weighting's comm hook,
    # whose Python hook is a fifth or more of a small model's step (calibrated without, plans ran short).
    from hetsplit.distributed import calibrate

    seen, real = [], calibrate.weight_gradients
    calibrate.weight_gradients = lambda ddp, plan, **kw: (
        seen.append((type(ddp).__name__, plan.sizes)) or real(ddp, plan, **kw)
    )
    try:
        hd.plan(net, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=ctx.profile, calibrate=2)
    finally:
        calibrate.weight_gradients = real
    res["calibrated_with_the_hook"] = seen
    # What the calibration steps lasted beyond their slowest rank's work is in the predicted step:
    # here a 100 ms wait in every forward, not compute, which timing the bare all-reduce leaves out.
    slow = _net()
    slow.register_forward_pre_hook(lambda *_: time.sleep(0.1))
    res["steps"] = {
        "waiting": hd.plan(slow, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=ctx.profile,
                           calibrate=3, calibrate_seconds=0, quiet=True).step_time
    }  # fmt: skip
    waiting = _net()
    waiting.register_forward_pre_hook(lambda *_: time.sleep(0.03))
    # The calibration runs more steps than `calibrate` until they took `calibrate_seconds`.
    counted, real_step = [], calibrate.train_step
    calibrate.train_step = lambda *a, **kw: counted.append(1) or real_step(*a, **kw)
    try:
        for seconds in (0, 0.5):
            counted.clear()
            hd.plan(waiting, x, 40, device=device, loss_fn=F.cross_entropy, target=y, profile=ctx.profile,
                    calibrate=3, calibrate_seconds=seconds, quiet=True)  # fmt: skip
            res[f"calibration_steps_{seconds}"] = len(counted) - 3  # less the lone step and 2 warm-up steps
    finally:
        calibrate.train_step = real_step
    return res


def calibration_failure(ctx):
    def failing_loss(out, tgt):
        if ctx.rank == 1:
            raise RuntimeError("this loss fails on rank 1")
        return F.cross_entropy(out, tgt)

    x, y = _batch(8)
    try:
        hd.plan(_net(), x, 40, device=_device(ctx), loss_fn=failing_loss, target=y, profile=ctx.profile)
    except hd.DistributedError as e:
        return str(e)
    return None


EXACT = {  # scenario: (how it steps, the bound on its relative gradient error)
    "hook": (functools.partial(_ddp_step, sizes=[7, 3]), 1e-6),
    "hook_zero_rank": (functools.partial(_ddp_step, sizes=[10, 0]), 1e-6),
    "hook_any_size": (functools.partial(_ddp_step, sizes=[7, 3], with_plan=False), 1e-6),
    "hook_any_size_zero": (functools.partial(_ddp_step, sizes=[10, 0], with_plan=False), 1e-6),
    "hook_sum": (functools.partial(_ddp_step, sizes=[7, 3], reduction="sum"), 1e-6),
    "outputs": (functools.partial(_ddp_step, sizes=[7, 3], method="outputs"), 1e-6),
    "outputs_zero": (functools.partial(_ddp_step, sizes=[10, 0], method="outputs"), 1e-6),
    "outputs_sum": (functools.partial(_ddp_step, sizes=[7, 3], method="outputs", reduction="sum"), 1e-6),
    # The outputs method leaves the comm hook free: torch's own averaging hook still gives the full batch.
    "outputs_user_hook": (functools.partial(_ddp_step, sizes=[7, 3], method="outputs", user_hook="allreduce"), 1e-6),
    "plain_equal_shares": (functools.partial(_ddp_step, sizes=[5, 5], hook=False), 1e-6),
    # micro-batches under no_sync, weighted by their samples
    "micro_hook": (functools.partial(_micro_step, sizes=[7, 5], micro=[[3, 2, 2], [5]], method="hook"), 1e-9),
    "micro_outputs": (functools.partial(_micro_step, sizes=[7, 5], micro=[[3, 2, 2], [5]], method="outputs"), 1e-9),
    "micro_both_ranks": (functools.partial(_micro_step, sizes=[6, 4], micro=[[3, 3], [2, 1, 1]], method="hook"), 1e-9),
    "micro_zero_share": (functools.partial(_micro_step, sizes=[10, 0], micro=[[4, 3, 3], []], method="hook"), 1e-9),
    "micro_zero_share_outputs": (
        functools.partial(_micro_step, sizes=[10, 0], micro=[[4, 3, 3], []], method="outputs"),
        1e-9,
    ),
}


def plain_uneven_shares(ctx):
    return _ddp_step(ctx, [7, 3], hook=False)


def outputs_new_plan(ctx):
    # A plan change (what DistributedRebalancer does): the next step is weighted by the new plan.
    ddp = DDP(_net())
    state = hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]), method="outputs")
    state.set_plan(plan_from_sizes(None, ["a", "b"], [2, 8]))
    xf, yf = _batch(10)
    xs, ys = (xf[:2], yf[:2]) if ctx.rank == 0 else (xf[2:], yf[2:])
    F.cross_entropy(ddp(xs), ys).backward()
    ref = _net()
    F.cross_entropy(ref(xf), yf).backward()
    return max_rel_grad_error(ddp.module, ref)


def zero_share_loader(ctx):
    # The README's recipe with a rank the plan gives nothing: it still takes part in every step.
    # With BatchNorm, which cannot train on one sample (as a ResNet's last stage on small images).
    zero_plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 0])
    full_x, full_y = _batch(12)
    loader = hd.data_loader(torch.utils.data.TensorDataset(full_x, full_y), zero_plan, shuffle=False)
    zddp = DDP(mlp(6, 5, 3, batch_norm=True))
    hd.weight_gradients(zddp, zero_plan)
    shapes = []
    for bx, by in loader:
        shapes.append(len(bx))
        zddp.zero_grad()
        F.cross_entropy(zddp(bx), by).backward()  # the zero share's real samples: weighted by 0
    zref = mlp(6, 5, 3, batch_norm=True)
    for rows in (slice(0, 6), slice(6, 12)):  # rank 0 ran each global batch whole: BatchNorm saw its statistics
        zref.zero_grad()
        F.cross_entropy(zref(full_x[rows]), full_y[rows]).backward()
    # A deep copy of the weighted model (an EMA or evaluation copy) runs unweighted, any batch size.
    twin = copy.deepcopy(zddp.module)
    return {"shapes": shapes, "err": max_rel_grad_error(zddp.module, zref), "copy_runs": tuple(twin(full_x[:5]).shape)}


def off_plan_outputs(ctx):
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]), method="outputs")
    with torch.no_grad():
        res = {"eval_shape": list(ddp(_batch(5)[0]).shape)}  # evaluation: any size, no check
    try:
        ddp(_batch(5)[0])
    except hd.DistributedError as e:
        res["error"] = str(e)
    return res


def off_plan_hook(ctx):
    ddp = DDP(_net())
    hd.weight_gradients(ddp, plan_from_sizes(None, ["a", "b"], [7, 3]))
    try:
        ddp(_batch(5)[0])  # 5 samples where the plan says 7 or 3
    except hd.DistributedError as e:
        return str(e)
    return None


def sampler(ctx):
    sampler = hd.HeteroDistributedSampler(list(range(23)), plan_from_sizes(None, ["a", "b"], [7, 3]), seed=5)
    return {"indices": [i for step in sampler for i in step], "steps": sampler.steps}


def summed_loss(ctx):
    # pytorch/examples' FSDP2 script trains on model(x).sum(): a sum over the batch, which the
    # default reduction="mean" weights wrongly; it is detected once, naming reduction="sum".
    import warnings

    x, _ = _batch(8)
    xs = x[:6] if ctx.rank == 0 else x[6:]
    plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    ref = _net()
    ref(x).sum().backward()
    res = {}
    for method in ("hook", "outputs"):
        for reduction in ("mean", "sum"):
            ddp = DDP(_net())
            hd.weight_gradients(ddp, plan, method=method, reduction=reduction)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):  # once, not every step
                    ddp.zero_grad()
                    ddp(xs).sum().backward()
            said = [str(w.message) for w in caught if "reduction='sum'" in str(w.message)]
            res[f"{method}-{reduction}"] = {"err": max_rel_grad_error(ddp.module, ref), "said": said}
    ddp = DDP(_net())  # a mean loss is not taken for a sum
    hd.weight_gradients(ddp, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp(xs).mean().backward()
        ddp.zero_grad()
        F.cross_entropy(ddp(xs), _batch(8)[1][:6] if ctx.rank == 0 else _batch(8)[1][6:]).backward()
    res["mean_said"] = [str(w.message) for w in caught if "reduction='sum'" in str(w.message)]
    return res


def local_batch(ctx):
    # A script that cuts its global batches itself (pytorch/examples cuts by the plan's sizes):
    # hd.local_batch cuts as hd.data_loader does, a zero share's two stand-in rows weighted 0.
    x, y = _batch(8)
    zero = plan_from_sizes(None, ["rank0", "rank1"], [8, 0])
    res = {}
    for with_plan in (True, False):
        ddp = DDP(_net())
        hd.weight_gradients(ddp, zero if with_plan else None)
        xb, yb = hd.local_batch((x, y), zero)
        F.cross_entropy(ddp(xb), yb).backward()
        ref = _net()
        F.cross_entropy(ref(x), y).backward()
        res[f"zero-plan={with_plan}"] = {"rows": len(xb), "err": max_rel_grad_error(ddp.module, ref)}
    # An epoch's short last global batch (5 of 8): cut in the plan's proportions, every row once.
    uneven = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    ddp = DDP(_net())
    hd.weight_gradients(ddp)
    xb, yb = hd.local_batch((x[:5], y[:5]), uneven)
    F.cross_entropy(ddp(xb), yb).backward()
    ref = _net()
    F.cross_entropy(ref(x[:5]), y[:5]).backward()
    res["short"] = {"rows": len(xb), "err": max_rel_grad_error(ddp.module, ref)}
    try:
        hd.local_batch(torch.zeros(9, 2), uneven)
    except ValueError as e:
        res["too_long"] = str(e)
    return res


def dtype_mismatch(ctx):
    # float64 on one rank, float32 on the other: DDP's first broadcast would abort a rank (signal 6).
    net, x = (_net(), _batch(8)[0]) if ctx.rank == 0 else (_net().float(), _batch(8)[0].float())
    try:
        hd.plan(net, x, 16, weights=[1, 1])
    except hd.DistributedError as e:
        return str(e)
    return None


def version_mismatch(ctx):
    import hetsplit.distributed.rank_plan as plan_module  # where the version is read

    real = plan_module.__version__
    plan_module.__version__ = real if ctx.rank == 0 else "0.0.0-other"
    try:
        hd.plan(_net(), _batch(8)[0], 40, device=_device(ctx))
    except hd.DistributedError as e:
        return str(e)
    finally:
        plan_module.__version__ = real
    return None


def plan_mismatch(ctx):
    try:
        verify_plan(plan_from_sizes(None, ["a", "b"], [5, 5] if ctx.rank == 0 else [6, 4]))
    except hd.DistributedError as e:
        return str(e)
    return None


def hung_rank(ctx):
    # A rank that hangs: the other stops with a clear error once the group's timeout ends.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    if ctx.rank == 1:
        time.sleep(6)
        return None
    start = time.perf_counter()
    try:
        verify_plan(plan_from_sizes(None, ["a", "b"], [7, 3]), group=short)
    except hd.DistributedError as e:
        return {"error": str(e), "after": time.perf_counter() - start}
    return {"error": None, "after": time.perf_counter() - start}


SCENARIOS = {
    "plan": plan,
    "batchnorm_plan": batchnorm_plan,
    "weighted_caps": weighted_caps,
    "calibration": calibration,
    "zero_share_calibration": zero_share_calibration,
    "calibration_failure": calibration_failure,
    **{name: step for name, (step, _) in EXACT.items()},
    "plain_uneven_shares": plain_uneven_shares,
    "outputs_new_plan": outputs_new_plan,
    "zero_share_loader": zero_share_loader,
    "off_plan_outputs": off_plan_outputs,
    "off_plan_hook": off_plan_hook,
    "sampler": sampler,
    "summed_loss": summed_loss,
    "local_batch": local_batch,
    "dtype_mismatch": dtype_mismatch,
    "version_mismatch": version_mismatch,
    "plan_mismatch": plan_mismatch,
    "hung_rank": hung_rank,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(SCENARIOS, tmp_path_factory.mktemp("dist"))


# -- one test a scenario ----------------------------------------------------------------------


def test_all_ranks_agree_on_the_plan(ranks):
    plans = [r["measured"] for r in ranks["plan"]]
    assert plans[0] == plans[1]
    assert plans[0]["devices"] == ["rank0:cpu", "rank1:cpu@0.25"] and sum(plans[0]["sizes"]) == 40
    assert plans[0]["emulated"] == ["rank1:cpu@0.25"]
    given = [r["given"] for r in ranks["plan"]]
    assert given[0] == given[1] and given[0]["sizes"] == [32, 8]  # the quarter-speed rank gets a fifth


def test_a_plan_on_flagged_measurements_carries_the_note_into_an_integration_s_line(ranks):
    notes = [r["notes"] for r in ranks["plan"]]
    assert notes[0] == notes[1] and len(notes[0]) == 1, notes  # the same plan on every rank
    assert notes[0][0].startswith("emulation unreliable: rank1:cpu@0.25 measured 2.0x slower than cpu, not 4x")
    said = ranks["plan"][0]["integration"]
    assert len(said) == 1 and said[0].startswith("hetsplit: HeteroDDPStrategy: global batch 40 split"), said
    assert said[0].endswith("; " + notes[0][0]) and ranks["plan"][1]["integration"] == []


def test_the_plan_is_said_once_on_rank_0_unless_quiet(ranks):
    said, other = (r["said"] for r in ranks["plan"])
    assert other == [] and len(said) == 1, said  # once: not on rank 1, nor with quiet=True
    # Each share beside the time its rank's curve predicts for it.
    assert re.match(
        r"hetsplit: hd\.plan: global batch 40 split rank0:cpu 32 \(80%, [\d.]+ ms\), "
        r"rank1:cpu@0\.25 8 \(20%, [\d.]+ ms\); predicted step ",
        said[0],
    ), said
    assert said[0].endswith("not real hardware): cpu@0.25"), said


def test_an_emulated_rank_off_its_speed_against_a_real_rank_is_named_in_one_line():
    from hetsplit.profiler import emulation_warning as _emulation_warning

    def gathered(slower):  # as hd.plan gathers the ranks' profiles: labelled rank{r}:{device}
        prof = Profile.from_measurements(
            {"cpu": [(2, 0.01), (8, 0.04)], "cpu@0.25": [(2, 0.01 * slower), (8, 0.04 * slower)]}
        )
        prof.entries[1].info = dataclasses.replace(prof.entries[1].info, emulated=True, speed=0.25)
        for r, e in enumerate(prof.entries):
            e.info.name = f"rank{r}:{e.info.name}"
        return prof

    line = _emulation_warning(gathered(1.2))
    assert line.startswith("emulation unreliable here") and "cpu@0.25 measured 1.2x slower than cpu, not 4x" in line
    assert "\n" not in line
    assert _emulation_warning(gathered(4.0)) is None  # within 1.3x of its speed


def test_the_predicted_step_is_the_calibration_steps_scaled_to_the_new_shares():
    from hetsplit.distributed.calibrate import _stepwise

    # Two ranks, each the slower one in every other step: their medians are equal (15 ms), but
    # every step took 20 ms plus 1 ms beyond its slowest rank's compute (walls from a barrier).
    steps = [([0.021, 0.021], [0.010, 0.020]), ([0.021, 0.021], [0.020, 0.010])] * 3
    plan = dataclasses.replace(plan_from_sizes(None, ["rank0", "rank1"], [30, 10]), times=[0.015, 0.015])
    assert _stepwise(plan, [0.015, 0.015], steps) == pytest.approx(0.021)
    # New shares scale each rank's compute in every step by its planned over its median compute:
    # rank 0 from 10 ms to 30, rank 1 from 20 ms to 10, so rank 0 is now the slowest. Each rank
    # keeps its own wall less compute of that step (rank 0's 11 ms: its waits and its own work,
    # which one step cannot tell apart), so the prediction is an upper bound there.
    steps = [([0.021, 0.021], [0.010, 0.020])] * 3
    plan = dataclasses.replace(plan, times=[0.030, 0.010])
    assert _stepwise(plan, [0.010, 0.020], steps) == pytest.approx(0.030 + 0.011)


def test_a_rank_whose_compute_absorbs_its_waits_leaves_the_other_rank_s_own_time_in_the_step():
    """An emulated rank (or a GPU behind its host) computes while it waits: its wall less compute is 0.

    The real CPU rank spends 3 ms of its own each step beyond its compute (DDP's buckets, the
    hook). Rebalanced, it becomes the slowest, and its 3 ms are in the step: taken as one figure
    for every rank (the least), they were not, and DDP plans on cpu,cpu@0.25 ran 7.6 % longer.
    """
    from hetsplit.distributed.calibrate import _stepwise

    steps = [([0.0114, 0.0124], [0.0084, 0.0124])] * 5  # rank 0: 8.4 ms compute + 3 ms; rank 1 absorbs its waits
    plan = dataclasses.replace(plan_from_sizes(None, ["rank0", "rank1"], [454, 58]), times=[0.0095, 0.0095])
    assert _stepwise(plan, [0.0084, 0.0124], steps) == pytest.approx(0.0095 + 0.003)


def test_what_a_step_took_beyond_compute_ignores_the_busiest_rank_s_head_start():
    from hetsplit.timing import exposed

    # A controlled step: rank r leaves the barrier at start[r], computes compute[r], then
    # spends 2 ms of its own (hooks, zero_grad); the step ends for every rank 3 ms after the
    # last of them (the all-reduce no compute hid). The busiest rank (1) left the barrier first.
    start, compute, own, tail = [0.004, 0.0], [0.018, 0.022], 0.002, 0.003
    end = max(s + c + own for s, c in zip(start, compute)) + tail
    walls = [end - s for s in start]
    assert exposed(walls, compute) == pytest.approx(own + tail)  # the shortest wall less 22 ms: 1 ms
    # The steady loop's step (no barrier: every rank starts together) is what the rule predicts.
    steady = max(c + own for c in compute) + tail
    assert max(compute) + exposed(walls, compute) == pytest.approx(steady)
    # Equal computes: every rank's wall less its compute is at least the one that held the step up.
    start, compute = [0.0, 0.001], [0.020, 0.020]
    end = max(s + c + own for s, c in zip(start, compute)) + tail
    assert exposed([end - s for s in start], compute) == pytest.approx(own + tail)


def test_a_rank_given_no_share_calibrates_on_its_stand_ins(ranks):
    for r in ranks["zero_share_calibration"]:
        assert r["sizes"] == [40, 0] and r["calibrated"] == [[40, 0]], r  # was: not calibrated at all
        assert 0 < r["stand_in_time"] < 1.0, r  # its measured stand-in step, not the profile's 2 s


def test_a_batchnorm_model_s_plan_hands_no_rank_a_single_sample(ranks):
    for r in ranks["batchnorm_plan"]:
        assert r == {"batchnorm": [8, 0], "plain": [7, 1]}, r


def test_hand_set_weights_respect_an_emulated_memory(ranks):
    for r in ranks["weighted_caps"]:
        assert r["micro"] == [[8], [2, 2, 2, 2]], r
        # No room under rank 0's cap for rank 1's sample to sit out: its share is raised to
        # BatchNorm's minimum (8 values per channel of a BatchNorm1d: 8 samples).
        assert r["capped"] == [8, 8], r
        assert r["moved"] == [[16, 0], [[4, 4, 4, 4], []]], r
        assert r["named"] == ["rank0:cpu", "rank1:cpu@0.25:max2"], r  # labelled as a profiled plan's devices
        assert "give rank 1 8 samples of 16 but its memory holds 2" in (r["error"] or ""), r
        assert "accumulate=True" in r["error"], r


def test_calibration_moves_the_plan_off_a_rank_slower_than_its_profile(ranks):
    results = ranks["calibration"]
    for r in results:
        assert r["uncalibrated"] == [20, 20]  # the shared profile says the ranks are equally fast
        assert r["calibrated"][0] >= 26, r["calibrated"]  # rank 1 really runs at a quarter speed
        assert r["model_untouched"]
    assert results[0]["calibrated"] == results[1]["calibrated"]


def test_calibration_runs_ddp_steps_with_the_shard_weighting_training_runs(ranks):
    for r in ranks["calibration"]:
        assert r["calibrated_with_the_hook"] == [["DistributedDataParallel", [20, 20]]], r  # (through JSON)


def test_the_predicted_step_holds_what_the_calibration_steps_spent_beyond_the_work(ranks):
    for r in ranks["calibration"]:
        steps = r["steps"]
        # At least the wait (less a rank's compute at most): the bare all-reduce left it out.
        assert steps["waiting"] >= 0.09, steps


def test_the_calibration_runs_more_steps_until_they_took_calibrate_seconds(ranks):
    for r in ranks["calibration"]:
        assert r["calibration_steps_0"] == 3, r  # calibrate_seconds=0: exactly `calibrate`
        # Every step waits 30 ms in its forward: 0.5 s is at most 17 of them, and more than 3.
        assert 3 < r["calibration_steps_0.5"] <= 17, r
    assert ranks["calibration"][0]["calibration_steps_0.5"] == ranks["calibration"][1]["calibration_steps_0.5"]


def test_a_calibration_step_failing_on_one_rank_is_reported_on_every_rank(ranks):
    for error in ranks["calibration_failure"]:  # not left hanging in DDP
        assert "failed on ranks {1: 'RuntimeError: this loss fails on rank 1'}" in error


@pytest.mark.parametrize("scenario", list(EXACT))
def test_weighted_gradients_equal_the_full_batch_gradients(ranks, scenario):
    # hook / outputs: the two weightings; _zero: a rank with 0 samples takes part; any_size: no
    # plan, each bucket carries its count; plain_equal_shares: DDP's plain mean is right then.
    bound = EXACT[scenario][1]
    for rank, err in enumerate(ranks[scenario]):
        assert err < bound, f"rank {rank}: relative gradient error {err:.2e}"


def test_plain_ddp_mean_is_biased_on_uneven_shares(ranks):
    assert all(err > 1e-2 for err in ranks["plain_uneven_shares"])  # the bias the hook removes


def test_a_plan_change_weights_the_next_step_by_the_new_plan(ranks):
    assert all(err < 1e-6 for err in ranks["outputs_new_plan"])


def test_a_step_off_the_plan_is_refused_with_the_hook(ranks):
    errors = ranks["off_plan_hook"]
    assert "rank 0: this step has 5 samples but the plan gives this rank 7" in errors[0]
    assert "plan gives this rank 3" in errors[1]


def test_a_step_off_the_plan_is_refused_with_the_outputs_method_but_evaluation_is_not(ranks):
    results = ranks["off_plan_outputs"]
    assert "rank 1: this step has 5 samples but the plan gives this rank 3" in results[1]["error"]
    assert all(r["eval_shape"] == [5, 3] for r in results)


def test_data_loader_serves_a_zero_share_and_copies_run_unweighted(ranks):
    results = ranks["zero_share_loader"]
    # The rank the plan gives 0 is served two real samples a step (BatchNorm cannot train on one),
    # never an empty batch.
    assert results[0]["shapes"] == [6, 6] and results[1]["shapes"] == [2, 2]
    for r in results:
        assert r["err"] < 1e-12  # float64: only rounding
        assert r["copy_runs"] == [5, 3]


def test_sampler_with_process_group_defaults(ranks):
    a, b = ranks["sampler"]
    assert a["steps"] == b["steps"] == 3
    assert len(a["indices"]) == 21 and len(b["indices"]) == 9
    assert set(a["indices"]) | set(b["indices"]) == set(range(23))


def test_a_summed_loss_under_the_mean_weighting_is_named_once_and_sum_is_exact(ranks):
    for rank, res in enumerate(ranks["summed_loss"]):
        for method in ("hook", "outputs"):
            mean, summed = res[f"{method}-mean"], res[f"{method}-sum"]
            assert mean["err"] > 1e-2 and len(mean["said"]) == 1, (rank, method, mean)  # off, and said once
            assert "model(x).sum()" in mean["said"][0] and "\n" not in mean["said"][0]
            assert summed["err"] < 1e-6 and not summed["said"], (rank, method, summed)
        assert not res["mean_said"], res["mean_said"]


def test_local_batch_cuts_a_global_batch_as_the_loader_does(ranks):
    for rank, res in enumerate(ranks["local_batch"]):
        for with_plan in (True, False):  # the zero share: two real rows, weighted 0 with or without the plan
            got = res[f"zero-plan={with_plan}"]
            assert got["rows"] == [8, 2][rank] and got["err"] < 1e-6, (rank, with_plan, got)
        assert res["short"]["rows"] == [4, 1][rank] and res["short"]["err"] < 1e-6, res["short"]
        assert "the global batch has 9 samples but the plan splits 8" in res["too_long"]


def test_ranks_with_different_dtypes_are_one_line_on_every_rank(ranks):
    for error in ranks["dtype_mismatch"]:
        assert "rank 0: parameters float64, batch float64; rank 1: parameters float32, batch float32" in error
        assert "use one dtype on every rank" in error and "\n" not in error


def test_different_versions_are_reported_on_every_rank(ranks):
    assert all("hetsplit versions differ" in error for error in ranks["version_mismatch"])


def test_different_plans_are_reported_on_every_rank(ranks):
    assert all("ranks [1] hold a different plan" in error for error in ranks["plan_mismatch"])


def test_a_hung_rank_becomes_a_clear_error(ranks):
    res = ranks["hung_rank"][0]
    assert res["error"].startswith(
        "rank 0: comparing plans failed: rank 1 did not answer within the 3 s timeout: it hangs"
    )
    assert "\n" not in res["error"]
    assert res["after"] < 15


def test_a_zero_share_is_predicted_as_the_stand_ins_its_rank_runs():
    """A rank with no share runs two samples weighted 0 every step: at a quarter speed that can be the step."""
    from hetsplit.distributed.rank_plan import _with_stand_ins
    from hetsplit.planning import plan_from_sizes
    from hetsplit.planning.profile import Profile

    prof = Profile.from_measurements({"fast": [(2, 0.01), (64, 0.1)], "slow": [(2, 0.5), (64, 2.0)]})
    plan = plan_from_sizes(prof, ["fast", "slow"], [64, 0])
    assert plan.step_time == pytest.approx(0.1)  # what was predicted: the slow rank's stand-ins counted as nothing
    timed = _with_stand_ins(plan, prof)
    assert timed.sizes == [64, 0] and timed.step_time == pytest.approx(0.5)
    assert _with_stand_ins(plan_from_sizes(prof, ["fast", "slow"], [60, 4]), prof).times[1] > 0.5


def test_a_zero_share_takes_the_samples_its_stand_ins_would_cost():
    """Equal ranks whose fixed cost swamps a sample: [8, 0] was solved (a zero counted as free); [6, 2] is no slower."""
    from hetsplit.distributed.rank_plan import _stand_ins_used, _with_stand_ins
    from hetsplit.planning import plan_from_sizes
    from hetsplit.planning.profile import Profile

    prof = Profile.from_measurements({"a": [(1, 0.100), (8, 0.101)], "b": [(1, 0.103), (8, 0.104)]})
    zero = plan_from_sizes(prof, ["a", "b"], [8, 0])
    used = _stand_ins_used(zero, prof)
    assert used.sizes == [6, 2]
    assert _with_stand_ins(used, prof).step_time <= _with_stand_ins(zero, prof).step_time
    # A cap of 1 sample: the stand-in rank takes the one it holds.
    capped = Profile.from_measurements({"a": [(1, 0.1), (8, 0.101)], "b": [(1, 0.103), (8, 0.104)]}, {"b": 1})
    assert _stand_ins_used(plan_from_sizes(capped, ["a", "b"], [8, 0]), capped).sizes == [7, 1]
    fast = Profile.from_measurements({"a": [(1, 0.01), (8, 0.08)], "b": [(1, 0.5), (8, 4.0)]})
    assert _stand_ins_used(plan_from_sizes(fast, ["a", "b"], [8, 0]), fast).sizes == [6, 2]  # 1.0 s either way
