"""FSDP2 (``fully_shard``) in hetsplit.distributed on two gloo ranks, float64, against one full-batch process.

One run for the module (tests/helpers.py's two-rank runner); each scenario runs on both
ranks in turn and its result (or its traceback) is asserted by its own test below.
"""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import OOM_LOOP, mlp, run_ranks
from torch import nn

import hetsplit
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes

fully_shard = fsdp.fully_shard

WORLD = 2
N = 30  # samples in the data set: three global batches of 10


def _net(width=8):
    return mlp(6, width, 5, 3)


def _sharded(root_only=False, width=8):
    model = _net(width)
    if not root_only:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
    return fully_shard(model)


def _data():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def _plan(sizes, micro=None):
    if micro is None:
        return plan_from_sizes(None, [f"rank{r}" for r in range(WORLD)], sizes)
    return hetsplit.Plan([f"rank{r}" for r in range(WORLD)], sizes, [0.0] * WORLD, sum(sizes), micro_batches=micro)


def _full(model):
    return [p.full_tensor().detach() for p in model.parameters()]


def _reference(batches, width=8):
    """A plain single-process model trained with Adam on the same global batches (index lists)."""
    data = _data()
    ref = _net(width)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for idx in batches:
        x, y, _ = data[torch.tensor(sorted(idx))]
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


def _max_err(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def _train(plan, *, weighted_plan="same", micro=False, steps=3, epoch_of=None, zero_share="sample"):
    """Steps of Adam on an FSDP2 model fed by hd.data_loader; returns the error vs the reference and what ran."""
    model = _sharded()
    hd.weight_gradients(model, plan if weighted_plan == "same" else None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = hd.data_loader(_data(), plan, shuffle=True, seed=1, zero_share=zero_share)
    seen, sizes, forwards = [], [], []
    for step, (x, y, idx) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        if micro:
            for xm, ym, _ in hd.micro_batches(model, (x, y, idx), plan, device="cpu"):
                forwards.append(len(xm))
                F.cross_entropy(model(xm), ym).backward()
        else:
            forwards.append(len(x))
            F.cross_entropy(model(x), y).backward()
        opt.step()
        real = loader.batch_sampler.real_rows(step) if plan.sizes[dist.get_rank()] > 0 else 0
        mine = idx.tolist()[:real] if plan.sizes[dist.get_rank()] > 0 else []
        every = [None] * WORLD
        dist.all_gather_object(every, mine)
        seen.append(every)
        sizes.append(len(x))
    batches = [[i for part in every for i in part] for every in seen]
    return {
        "err": _max_err(_full(model), _reference(batches)),
        "sizes": sizes,
        "forwards": forwards,
        "batches": batches,
    }


# -- the scenarios, in the order the ranks run them ------------------------------------------


def uneven(ctx):
    return _train(_plan([7, 3]))


def zero_share(ctx):
    return _train(_plan([10, 0]))


def no_plan(ctx):
    return _train(_plan([7, 3]), weighted_plan=None)


def micro(ctx):
    return _train(_plan([7, 3], [[3, 2, 2], [3]]), micro=True)


def micro_fillers(ctx):
    return _train(_plan([8, 2], [[2, 2, 2, 2], [2]]), micro=True)


def micro_zero_share(ctx):
    return _train(_plan([10, 0], [[4, 3, 3], []]), micro=True)


def llama(ctx):
    return _llama(ctx.rank)


def planned(ctx):
    return _planned(ctx.rank)


def rebalancer(ctx):
    return _rebalanced(ctx.rank)


def checkpoint(ctx):
    return _checkpoint(ctx.rank, ctx.tmp_path)


def refusals(ctx):
    return _refusals(ctx.rank)


def waits(ctx):
    return _waits(ctx.rank)


def calibrated(ctx):
    """hd.plan calibrates a sharded plan on the sharded model's own steps, in place.

    A 100 ms wait in every forward (not compute) is in the predicted step: its steps' walls,
    beyond their slowest rank's compute; the collectives timed once at their sizes leave it out.
    """
    model = _sharded()
    model.register_forward_pre_hook(lambda *_: time.sleep(0.1))
    before, rng = _full(model), torch.get_rng_state()
    x, y, _ = _data()[:8]
    device = "cpu" if ctx.rank == 0 else "cpu@0.25"
    plan = hd.plan(model, x, N, device=device, loss_fn=F.cross_entropy, target=y, batch_sizes=[2, 4, 8], repeats=1,
                   warmup=0, time_budget=1, calibrate=2, calibrate_seconds=0, quiet=True)  # fmt: skip
    untouched = _max_err(_full(model), before) == 0 and all(p.grad is None for p in model.parameters())
    return {"step": plan.step_time, "untouched": untouched and torch.equal(torch.get_rng_state(), rng)}


SCENARIOS = {
    fn.__name__: fn
    for fn in (uneven, zero_share, no_plan, micro, micro_fillers, micro_zero_share, llama, planned, rebalancer,
               checkpoint, refusals, waits, calibrated)
}  # fmt: skip


def _llama(rank):
    """A tiny Llama (transformers), fully_shard per decoder layer and root, its loss computed inside the model."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8,
    )  # fmt: skip

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).double()

    tokens = torch.randint(0, 32, (10, 8), generator=torch.Generator().manual_seed(0))
    model = build()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    plan = _plan([7, 3], [[3, 2, 2], [3]])
    hd.weight_gradients(model, plan)
    mine = tokens[:7] if rank == 0 else tokens[7:]
    for micro in hd.micro_batches(model, {"input_ids": mine, "labels": mine}, plan):
        model(**micro).loss.backward()  # a ModelOutput: its loss is scaled by the weighting
    got = [p.grad.full_tensor() for p in model.parameters()]
    # This model's own numerics differ by ~1e-8 between one batch of 10 and the same rows in
    # pieces, even in one process (float32 inside); so the reference runs the same pieces.
    ref = build()
    for start, stop in [(0, 3), (3, 5), (5, 7), (7, 8), (8, 9), (9, 10)]:
        rows = tokens[start:stop]
        (ref(input_ids=rows, labels=rows).loss * (stop - start) / 10).backward()
    full = build()
    full(input_ids=tokens, labels=tokens).loss.backward()
    return {
        "err": _max_err(got, [p.grad for p in ref.parameters()]),
        "err_full": _max_err(got, [p.grad for p in full.parameters()]),
    }


def _planned(rank):
    """hd.plan on the sharded model: rank 1 a quarter as fast, holding 4 samples (its share: micro-batches)."""
    from torch.distributed.tensor import DTensor

    model = _sharded(width=512)  # wide enough that a step's arithmetic outweighs its overhead: both ranks get work
    before = _full(model)
    data = _data()
    x, y, _ = data[:8]
    device = "cpu" if rank == 0 else "cpu@0.25:max4"
    rng, gathers, full_tensor = torch.get_rng_state(), [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: gathers.append(self.shape) or full_tensor(self, **kw)
    try:
        plan = hd.plan(
            model, x, N, device=device, loss_fn=F.cross_entropy, target=y, accumulate=True,
            batch_sizes=[2, 4, 8], repeats=1, time_budget=2,
        )  # fmt: skip
    finally:
        DTensor.full_tensor = full_tensor
    untouched = _max_err(_full(model), before) == 0 and all(p.grad is None for p in model.parameters())
    untouched = untouched and torch.equal(torch.get_rng_state(), rng)
    hd.weight_gradients(model, plan)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = hd.data_loader(data, plan, shuffle=False)
    biggest = 0
    for batch in loader:
        opt.zero_grad()
        for xm, ym, _ in hd.micro_batches(model, batch, plan, device=device):  # raises beyond the cap
            biggest = max(biggest, len(xm))
            F.cross_entropy(model(xm), ym).backward()
        opt.step()
    ref = _reference([list(range(N))], width=512)
    err = _max_err(_full(model), ref)
    # Planning again with the weighting on the model: the profile's steps are no training steps (its
    # hooks neither check their sizes against the plan nor count them).
    again = hd.plan(model, x, N, device=device, loss_fn=F.cross_entropy, target=y, batch_sizes=[2, 4], repeats=1,
                    warmup=0, time_budget=0.5)  # fmt: skip
    out = {"plan": plan.to_dict(), "untouched": untouched, "biggest": biggest, "err": err, "gathers": len(gathers)}
    return {**out, "again": again.sizes}


def _rebalanced(rank):
    """DistributedRebalancer, unchanged, on an FSDP2 model: every plan change still gives full-batch steps.

    Rank 1 at a quarter of the speed, timed on the library's own clock: each rank's compute, without
    its waits in FSDP2's all-gathers and reduce-scatters (by the wall both ranks would be as slow as
    the slower, and a slow-down milder than 20x vanished into the waiting on a loaded machine).
    """
    model = _sharded()
    plan = _plan([5, 5])
    state = hd.weight_gradients(model, plan)
    loader = hd.data_loader(_data(), plan, shuffle=False)
    sampler = loader.batch_sampler
    rb = hd.DistributedRebalancer(plan, hetsplit.Rebalancer(every=1, threshold=0.0), sampler=sampler,
                                  gradients=state, model=model, device="cpu" if rank == 0 else "cpu@0.25")  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sizes = []
    for _ in range(2):
        for x, y, _ in loader:
            with rb.step(), rb.device.throttle():
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
            opt.step()
            sizes.append(len(x))
    ref = _reference([list(range(0, 10)), list(range(10, 20)), list(range(20, 30))] * 2)
    changes = [{"old": c.old_sizes, "new": c.new_sizes, "faster": c.new_time < c.old_time} for c in rb.history]
    return {"err": _max_err(_full(model), ref), "sizes": sizes, "changes": changes}


def _checkpoint(rank, tmp):
    """DCP: save an FSDP2 model and its Adam state after a step on one plan, resume on another."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = _data()
    first, second = _plan([7, 3]), _plan([2, 8])
    model = _sharded()
    hd.weight_gradients(model, first)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y, _ = data[0:7] if rank == 0 else data[7:10]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(tmp) / "ckpt"))
    # Resume on another plan, in new objects: the second step equals the full-batch one.
    model = _sharded()
    hd.weight_gradients(model, second)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(Path(tmp) / "ckpt"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    x, y, _ = data[10:12] if rank == 0 else data[12:20]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ref = _reference([list(range(0, 10)), list(range(10, 20))])
    return {"err": _max_err(_full(model), ref)}


def _refusals(rank):
    """Each refused model: the error every rank raises (one line), or None if it was accepted."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except (hd.DistributedError, ValueError) as e:
            out[name] = str(e)

    plan = _plan([7, 3])
    attempt("different", lambda: hd.weight_gradients(_sharded(root_only=rank == 1), plan))
    attempt("hook", lambda: hd.weight_gradients(_sharded(), plan, method="hook"))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    attempt("hsdp", lambda: hd.weight_gradients(fully_shard(_net(), mesh=mesh), plan))
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(_net(), device_id=torch.device("cpu"))
    attempt("fsdp1", lambda: hd.weight_gradients(fsdp1, plan))
    attempt("fsdp1_micro", lambda: next(iter(hd.micro_batches(fsdp1, torch.zeros(7 if rank == 0 else 3, 6), plan))))
    attempt("off_plan", lambda: _off_plan(plan))
    # Rank 1 holds no batch of the ladder: every rank stops with one line (not rank 1 alone, the other waiting).
    device = "cpu" if rank == 0 else "cpu:max1"
    kwargs = {"device": device, "loss_fn": F.cross_entropy, "target": torch.zeros(4, dtype=torch.long)}
    attempt("no_batch_fits", lambda: hd.plan(_sharded(), torch.zeros(4, 6, dtype=torch.float64), 8, **kwargs,
                                             batch_sizes=[2, 4], repeats=1, warmup=0))  # fmt: skip
    return out


SLEEP = 0.5  # seconds rank 1 sleeps where rank 0 waits for it: the test's clock


def _waits(rank):
    """Rank 0's compute while rank 1 sleeps before its forward (and, on the wall clock, in its backward).

    Rank 0 waits for rank 1 in FSDP2's all-gathers: that wait is rank 1's time, not rank 0's work.
    """
    import time

    from hetsplit import emulation
    from hetsplit.distributed.sharded_profile import profile_sharded
    from hetsplit.timing import StepTimer

    model = _sharded()
    x, y, _ = _data()[:4]
    sleeping = model.register_forward_pre_hook(lambda *_: time.sleep(SLEEP)) if rank == 1 else None
    # The sharded profile: rank 1 is asleep in every one of its steps, rank 0 waiting for it.
    prof = profile_sharded(model, x, "cpu", F.cross_entropy, target=y, batch_sizes=[2, 4], repeats=1, warmup=0)
    out = {"profiled": [t for m in prof.entries[0].measurements for t in m.times]}
    # The CUDA path's pauses around FSDP2's waits, on the CPU with a wall clock (which counts every wait):
    # rank 1 sleeps before its forward and at the start of its backward.
    dev = hetsplit.parse_devices("cpu")[0]
    counter = emulation.compute_counter
    emulation.compute_counter = lambda device: time.perf_counter
    try:
        for pause in (True, False):
            timer, began = StepTimer(dev, model, pause_at_waits=pause), time.perf_counter()
            with timer.step() as lap:
                loss = F.cross_entropy(model(x), y)
                if sleeping is not None:
                    loss.register_hook(lambda g: time.sleep(SLEEP))
                loss.backward()
            out["paused" if pause else "whole"] = (lap.seconds(), time.perf_counter() - began)
            timer.remove()
            model.zero_grad(set_to_none=True)
    finally:
        emulation.compute_counter = counter
        if sleeping is not None:
            sleeping.remove()
    return out


def _off_plan(plan):
    model = _sharded()
    hd.weight_gradients(model, plan)
    model(torch.zeros(5, 6, dtype=torch.float64))  # 5 samples where the plan says 7 or 3


def test_a_rank_s_compute_leaves_out_its_wait_for_a_sleeping_peer(ranks):
    r0, _ = ranks["waits"]
    # Each profiled step of rank 0 had rank 1 asleep for SLEEP in it; rank 0's own work on 4 samples
    # of a tiny MLP is milliseconds, and on a loaded machine (its wait for a core counts) well under
    # half a second. By the wall, every step would be >= SLEEP.
    assert len(r0["profiled"]) == 2 and max(r0["profiled"]) < SLEEP / 2, r0["profiled"]


def test_on_a_wall_clock_the_step_timer_pauses_at_fsdp2_s_waits(ranks):
    # The CUDA path (events on the compute stream, which stalls while FSDP2 waits for an all-gather),
    # run on the CPU with a wall clock: the pauses leave out both of rank 1's sleeps.
    r0, _ = ranks["waits"]
    paused, wall = r0["paused"]
    assert wall >= 2 * SLEEP and paused < SLEEP, r0["paused"]
    whole, wall = r0["whole"]
    assert whole >= 2 * SLEEP and whole <= wall, r0["whole"]  # unpaused, the lap is the wall


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, run_ranks(SCENARIOS, tmp, world=WORLD, timeout=60)


@pytest.fixture(scope="module")
def ranks(job):
    return job[1]


def test_an_uneven_plan_gives_the_full_batch_steps(ranks):
    for r in ranks["uneven"]:
        assert r["err"] < 1e-12  # float64, three Adam steps: only summation order differs
    r0, r1 = ranks["uneven"]
    assert r0["sizes"] == [7, 7, 7] and r1["sizes"] == [3, 3, 3]  # the plan's shares


def test_an_epoch_covers_the_data_once(ranks):
    r0, r1 = ranks["uneven"]  # three steps: one epoch
    assert r0["batches"] == r1["batches"]
    every = [i for batch in r0["batches"] for i in batch]
    assert sorted(every) == list(range(N))  # each sample once, none twice


def test_a_zero_share_runs_two_samples_weighted_zero(ranks):
    r0, r1 = ranks["zero_share"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12
    assert r0["sizes"] == [10, 10, 10] and r1["sizes"] == [2, 2, 2]  # never an empty batch, nor one BatchNorm refuses


def test_without_a_plan_the_sizes_are_exchanged(ranks):
    r0, r1 = ranks["no_plan"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12


def test_different_micro_batch_counts_do_not_deadlock_and_give_the_full_batch(ranks):
    r0, r1 = ranks["micro"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12
    # the plan gives rank 1 one micro-batch: it runs three (as many as rank 0), each synchronised
    assert r0["forwards"] == [3, 2, 2] * 3 and r1["forwards"] == [1, 1, 1] * 3


def test_micro_batches_with_fillers(ranks):
    r0, r1 = ranks["micro_fillers"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12
    # rank 1's two samples one at a time, then two fillers of its first two samples weighted 0
    assert r0["forwards"] == [2, 2, 2, 2] * 3 and r1["forwards"] == [1, 1, 2, 2] * 3


def test_micro_batches_with_a_zero_share(ranks):
    r0, r1 = ranks["micro_zero_share"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12
    assert r0["forwards"] == [4, 3, 3] * 3 and r1["forwards"] == [2, 2, 2] * 3  # the stand-in's two samples


def test_a_transformers_llama_with_its_loss_inside_the_model(ranks):
    r0, r1 = ranks["llama"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12  # the same pieces in one process
    assert r0["err_full"] < 1e-7  # one full batch: within the model's own float32 rounding


def test_plan_profiles_the_model_as_sharded_and_respects_the_emulated_cap(ranks):
    r0, r1 = ranks["planned"]
    assert r0["plan"] == r1["plan"]
    plan = r0["plan"]
    assert sum(plan["sizes"]) == N and plan["devices"] == ["rank0:cpu", "rank1:cpu@0.25:max4"]
    assert r0["gathers"] == r1["gathers"] == 0  # timed sharded, in turns: no unsharded copy of the model
    assert plan["sizes"][1] < plan["sizes"][0]  # the quarter-speed rank (a half-speed one drew 19 of 30 at load ~9)
    assert all(m <= 4 for m in plan["micro_batches"][1])  # the small device's cap
    assert r1["biggest"] <= 4
    assert r0["untouched"] and r1["untouched"]  # parameters, gradients (none) and the RNG as they were
    assert r0["again"] == r1["again"] and sum(r0["again"]) == N  # planned again with the weighting hooks on
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12


def test_the_rebalancer_works_unchanged(ranks):
    r0, r1 = ranks["rebalancer"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12
    for a, b in zip(r0["sizes"], r1["sizes"]):  # the global batch, or all of it on rank 0 and rank 1's filler
        assert a + b == 10 or (a, b) == (10, 2)
    assert r0["changes"] == r1["changes"] and r0["changes"], r0["changes"]  # the same plan changes on both ranks
    first = r0["changes"][0]
    assert first["new"][1] < first["old"][1] == 5, r0["changes"]  # the quarter-speed rank loses samples
    assert all(c["faster"] for c in r0["changes"]), r0["changes"]  # each predicted faster than the plan it replaced


def test_a_sharded_plan_is_calibrated_on_the_sharded_model_s_own_steps(ranks):
    for r in ranks["calibrated"]:
        assert r["step"] >= 0.09, r  # the 100 ms wait of every step (less a rank's compute at most)
        assert r["untouched"], r  # parameters, gradients (none) and the RNG state as they were
    assert ranks["calibrated"][0]["step"] == ranks["calibrated"][1]["step"]


def test_a_sharded_checkpoint_resumes_on_another_plan(ranks):
    r0, r1 = ranks["checkpoint"]
    assert r0["err"] < 1e-12 and r1["err"] < 1e-12


REFUSED = {  # each refused model: what its one line says on each rank
    "different": lambda r, text: text.startswith("ranks [1] shard the model differently from rank 0"),
    "hsdp": lambda r, text: "hybrid sharding (HSDP)" in text and "use FSDP2's fully_shard on a 1-D device mesh" in text,
    "fsdp1": lambda r, text: "FSDP1" in text and "use FSDP2's fully_shard" in text,
    "fsdp1_micro": lambda r, text: "FSDP1" in text,
    "hook": lambda r, text: 'method="hook"' in text,
    "off_plan": lambda r, text: f"rank {r}: this step has 5 samples but the plan gives this rank {[7, 3][r]}" in text,
    "no_batch_fits": lambda r, text: "{1: 'device cpu:max1 cannot run even batch 2 (out of memory)'}" in text,
}


@pytest.mark.parametrize("refused", list(REFUSED))
def test_refusals_are_one_line_on_every_rank(ranks, refused):
    for rank, r in enumerate(ranks["refusals"]):
        text = r[refused]
        assert text is not None, f"rank {rank}: accepted"
        assert REFUSED[refused](rank, text), f"rank {rank}: {text}"
        assert "\n" not in text


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_resumes_in_one_process(job):
    """The two ranks' checkpoint (after the first step) loads into a plain model and Adam: world size 1."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    tmp, ranks = job
    ranks["checkpoint"]  # ran through on both ranks
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp / "ckpt"))  # no process group: this process alone
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    x, y, _ = _data()[10:20]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    want = _reference([list(range(0, 10)), list(range(10, 20))])
    assert _max_err([p.detach() for p in model.parameters()], want) < 1e-12


def _gpu_worker(rank, init_file, out_dir):
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    model = _sharded(width=256).cuda()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 6, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (64,), generator=gen)
    plan = hd.plan(model, x, 64, device="cuda:0", loss_fn=F.cross_entropy, target=y, batch_sizes=[2, 8, 32],
                   repeats=1, time_budget=2, max_probe=64)  # fmt: skip
    hd.weight_gradients(model, plan)
    F.cross_entropy(model(x.cuda()), y.cuda()).backward()
    ref = _net(256)
    F.cross_entropy(ref(x), y).backward()
    got = [p.grad.full_tensor().cpu() for p in model.parameters()]
    out = {"plan": plan.to_dict(), "err": _max_err(got, [p.grad for p in ref.parameters()])}
    # The memory path: peaks of the sharded step fitted, the ladder stopped where the fit passes
    # the limit (a fraction of the device set to fall between 6 and 7 samples' predicted peak).
    from hetsplit.distributed.sharded_profile import profile_sharded

    model.zero_grad(set_to_none=True)
    kwargs = {"target": y, "batch_sizes": [2, 4, 8, 16, 32], "repeats": 1, "warmup": 1}
    memory = profile_sharded(model, x, "cuda:0", F.cross_entropy, **kwargs).entries[0].memory
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = memory(6.5) / total
    capped = profile_sharded(model, x, "cuda:0", F.cross_entropy, memory_fraction=fraction, **kwargs).entries[0]
    out["memory"] = {"per_sample": memory.per_sample, "cap": capped.memory_cap,
                     "measured": [m.batch for m in capped.measurements]}  # fmt: skip
    Path(out_dir, "gpu.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_plan_and_the_weighting_of_a_sharded_model(tmp_path):
    """hd.plan on an FSDP2 model on CUDA (profiled as sharded, its peaks fitted), one exact step; the memory cap."""
    mp.spawn(_gpu_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=1, join=True)
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert out["plan"]["sizes"] == [64] and out["err"] < 1e-12
    memory = out["memory"]
    assert memory["per_sample"] > 0 and memory["measured"] == [2, 4], memory  # stopped before 8 samples
    assert 5 <= memory["cap"] <= 7, memory  # where the fit meets the limit (6.5 samples, give or take a peak's noise)


def test_the_sharded_profile_stops_its_ladder_before_the_memory_fit_passes_the_device():
    # On CUDA a turn cannot probe for out-of-memory (the other ranks would wait in a collective):
    # the peaks measured so far, fitted as base + per_sample * b, decide where the ladder stops.
    from hetsplit.distributed.sharded_profile import _Turn, profile_sharded

    turn = _Turn(_net(), hetsplit.parse_devices("cpu")[0], torch.zeros(2, 6), None, None, True, 0.9)
    turn.limit, turn.peaks = 1000.0, {2: 300, 4: 500}  # 100 bytes of shards and workspace, 100 a sample
    assert turn.wants(8, budget=60.0, steps=3)  # 900 bytes predicted
    assert not turn.wants(16, budget=60.0, steps=3)  # 1,700 bytes
    assert turn.cap == 9  # the largest batch the fit keeps under the limit
    # Every sharded step pays its collectives: the budget never stops a turn below an even share,
    # where a curve of the small sizes alone would extrapolate that overhead's noise.
    turn.limit, turn.times, turn.even = None, {2: [0.1], 4: [0.2]}, 32
    assert turn.wants(32, budget=0.5, steps=3) and not turn.wants(64, budget=0.5, steps=3)
    # Nor while doubling the batch adds less than half as much time: the floor (the other ranks'
    # one-sample steps, the collectives) still hides this rank's own work.
    turn.times = {2: [0.1], 4: [0.14]}
    assert turn.wants(64, budget=0.5, steps=3)
    # A turn the budget stopped (not the memory) still has the cap where the fit meets the limit.
    turn = _Turn(_net(), hetsplit.parse_devices("cpu")[0], torch.zeros(2, 6), None, None, True, 0.9)
    turn.limit, turn.peaks, turn.times = 1000.0, {2: 300, 4: 500}, {2: [0.1], 4: [0.2]}
    assert turn.entry().memory_cap == 9
    # Peaks that do not grow with the batch: no cap, no division by zero.
    turn = _Turn(_net(), hetsplit.parse_devices("cpu")[0], torch.zeros(2, 6), None, None, True, 0.9)
    turn.limit, turn.peaks = 50.0, {1: 100, 2: 100}
    assert turn.wants(4, budget=60.0, steps=3) and turn.memory_cap() is None
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        profile_sharded(_net(), torch.zeros(2, 6), "cpu", memory_fraction=1.5)


def test_the_optimizer_s_state_is_counted_before_and_after_its_first_step():
    # On CUDA a sharded profile keeps this much free: the optimizer's state comes at its first step.
    from hetsplit.distributed.sharded_profile import optimizer_state_bytes

    net = _net()  # float64
    size = sum(p.numel() * 8 for p in net.parameters())
    assert optimizer_state_bytes(torch.optim.AdamW(net.parameters())) == 2 * size
    assert optimizer_state_bytes(torch.optim.SGD(net.parameters(), lr=0.1)) == 0
    assert optimizer_state_bytes(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == size
    assert optimizer_state_bytes(torch.optim.RMSprop(net.parameters(), momentum=0.9, centered=True)) == 3 * size
    opt = torch.optim.Adam(net.parameters())
    F.cross_entropy(net(torch.randn(4, 6, dtype=torch.float64)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert optimizer_state_bytes(opt) == held >= 2 * size  # what it holds (its step counters too)


def test_every_rank_of_a_sharded_model_runs_as_many_micro_batches_whatever_its_rows():
    # FSDP2's forwards are collective: the plan's largest count on every rank, for its share and
    # for a last global batch kept short (another number of rows), fillers (0) where rows run out.
    from hetsplit.distributed.sharded import micro_for_rows
    from hetsplit.planning import Plan

    plan = Plan(["a", "b"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    assert micro_for_rows(plan, 0, 6) == [2, 2, 2] and micro_for_rows(plan, 1, 2) == [1, 1, 0]
    assert micro_for_rows(plan, 0, 4) == [2, 1, 1] and micro_for_rows(plan, 1, 1) == [1, 0, 0]
    assert micro_for_rows(plan, 1, 0) == [0, 0, 0]
    whole = Plan(["a", "b"], [6, 2], [0.0, 0.0], 8, micro_batches=[[6], [2]])
    assert micro_for_rows(whole, 0, 5) == [5] and micro_for_rows(whole, 1, 2) == [2]


OOM_JOB = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes

dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=20))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 4])
hd.weight_gradients(model, plan)
original = model[2].forward

def forward(x):  # rank 1's memory runs out in its second step, as a GPU's would
    if rank == 1 and steps == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return original(x)

model[2].forward = forward
"""
OOM_JOB += OOM_LOOP  # the loop both out-of-memory jobs run


def test_a_peer_of_a_rank_that_ran_out_of_memory_and_went_on_gets_one_line_naming_it(tmp_path):
    # Was gloo's raw "Connection closed by peer" traceback on rank 0.
    from helpers import two_ranks

    script = tmp_path / "job.py"
    script.write_text(OOM_JOB)
    (code0, out0, err0), (_, out1, _) = two_ranks(script, cwd=tmp_path)
    assert "skipped the step" in out1
    assert code0 == 1 and "finished" not in out0, (out0, err0[-3000:])
    lines = err0.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err0, err0[-3000:]
    assert lines[0].startswith(
        "hetsplit: rank 0, step 1: training step failed: rank 1 ran out of memory at step 1 (CUDA out of memory"
    ), lines
