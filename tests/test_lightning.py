"""HeteroDDPStrategy in a 2-rank gloo Lightning job: exact steps, plan shares, micro-batches, metrics, resume.

Lightning re-runs the script to start its ranks, which cannot work inside pytest, so
this file is also the job: ``torchrun --standalone --nproc_per_node=2 test_lightning.py OUT``
runs every scenario in one launch (``cpu,cpu@1``: emulated ranks at full speed, so no
sleeping; float64) and each rank writes what it saw to ``OUT/rank{r}.json``; the tests
below read those files.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import torch
from integration_launch import LIGHTNING_PATTERNS, check

from hetsplit.devices import parse_device

__all__: list[str] = []

N, BATCH = 20, 4  # 20 samples, loader batch 4 on 2 ranks: a global batch of 8, 3 steps per epoch


# --------------------------------------------------------------------------- the job (run by torchrun)
def _job(out: Path) -> None:
    import io

    import lightning as L
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset
    from torchvision.models import mobilenet_v3_small

    import hetsplit
    from hetsplit.lightning import HeteroDDPStrategy
    from hetsplit.planning import plan_from_sizes

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    X, Y = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 1, dtype=torch.float64)
    data = TensorDataset(torch.arange(N), X, Y)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from data

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
            self.seen: list[list[int]] = []
            self.stand_in: list[bool] = []  # per training step: this rank ran a zero share's one stand-in sample
            self.val_seen: list[list[int]] = []
            self.first: list[torch.Tensor] | None = None

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            self.seen.append(idx.tolist())
            if self._trainer is not None:  # not the copy the strategy profiles
                self.stand_in.append(self._trainer.strategy.train_sampler.is_filler(batch_idx))
            loss = F.mse_loss(self(x), y)  # self(x): the weighting must not see this call as a step
            self.log("train_loss", loss, sync_dist=True)  # on_step
            self.log("train_epoch", loss, sync_dist=True, on_step=False, on_epoch=True)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.first is None:
                self.first = [p.detach().clone() for p in self.parameters()]

        def validation_step(self, batch, batch_idx):
            idx, x, y = batch
            if not self.trainer.sanity_checking:
                self.val_seen.append(idx.tolist())
            self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)  # on_epoch

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(strategy, **kwargs):
        kwargs = {"max_epochs": 1, **kwargs}
        return L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            **kwargs,
        )

    def loaders():
        return DataLoader(data, batch_size=BATCH, shuffle=True), DataLoader(data, batch_size=BATCH)

    def error(make) -> str:
        try:
            make()
        except ValueError as e:
            return str(e)
        return "no error"

    def gathered(obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out

    def scenario(sizes, *, save=None, **kwargs) -> dict:
        L.seed_everything(0)
        model = Net()
        init = Net()
        init.load_state_dict(model.state_dict())
        plan = plan_from_sizes(None, ["rank0", "rank1"], sizes) if sizes else None
        strategy = HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan, **kwargs.pop("strategy", {}))
        t = trainer(strategy, **kwargs)
        t.fit(model, *loaders())
        if save:
            t.save_checkpoint(save)
        steps = gathered(model.seen)  # [rank][step] -> indices
        ref = init.layer
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        losses, counts, plain, first = [], [], [], None
        # A share of 0 runs two samples weighted 0: a plan's zero share, or a small share's cut of a short last
        # global batch (a profiled plan of [7, 1] cuts the last 4 samples [4, 0]).
        stand_in = gathered(model.stand_in)
        for k in range(len(steps[0])):
            parts = [torch.tensor(steps[r][k], dtype=torch.long) for r in range(2) if not stand_in[r][k]]
            rank_means = [F.mse_loss(ref(X[p]), Y[p]).item() for p in parts if len(p)]
            plain.append(sum(rank_means) / len(rank_means) if len(rank_means) == 2 else math.nan)
            idx = torch.cat(parts)
            opt.zero_grad()
            loss = F.mse_loss(ref(X[idx]), Y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            counts.append(len(idx))
            if k == 0:
                first = [p.detach().clone() for p in ref.parameters()]
        diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))
        val_seen = gathered(model.val_seen)
        # Evaluation batches are cut in the plan's proportions; a rank whose cut of a batch is 0
        # is served two samples that count for nothing (the last, partial batch can do that).
        from hetsplit.planning.plan import sizes_from_weights

        def counted(r, k):
            total = min(2 * BATCH, N - 2 * BATCH * k)
            return sizes_from_weights(total, strategy.plan.sizes)[r] > 0

        val = torch.cat(
            [torch.tensor(v, dtype=torch.long) for r in range(2) for k, v in enumerate(val_seen[r]) if counted(r, k)]
        )
        with torch.no_grad():
            val_ref = F.mse_loss(ref(X[val]), Y[val]).item()
        metrics = {k: float(v) for k, v in t.callback_metrics.items()}
        return {
            "sizes": [len(s) for s in model.seen],
            "steps_run": len(model.seen),
            "global_step": t.global_step,
            "loader_len": len(t.train_dataloader),
            "covered": sorted({i for s in steps for step in s for i in step}),
            "first_step_diff": diff(model.first, first),
            "final_diff": diff(list(model.parameters()), list(ref.parameters())),
            "train_loss": metrics.get("train_loss"),
            "train_loss_ref": losses[-1],
            "train_loss_plain": plain[-1],
            "train_epoch": metrics.get("train_epoch"),
            "train_epoch_ref": sum(v * n for v, n in zip(losses, counts)) / sum(counts),  # each sample once
            "val_loss": metrics.get("val_loss"),
            "val_loss_ref": val_ref,
            "val_sizes": [len(v) for v in model.val_seen],
            "plan": list(strategy.plan.sizes),
            "changes": len(strategy.rebalancer.history) if strategy.rebalancer is not None else 0,
            "order": steps,
        }

    class MicroNet(L.LightningModule):
        """``net`` under ``loss``; records each training_step call's random state and what the steps returned."""

        def __init__(self, net, loss) -> None:
            super().__init__()
            self.net, self.loss = net, loss
            self.calls: dict[str, list] = {}  # "step:indices" -> [random state, calls, same state every call]
            self.shares: list[list[int]] = []
            self.outs: list[tuple[float, int]] = []
            self.first: list[torch.Tensor] | None = None
            self.before_zero: list[list[float]] = []  # what on_before_zero_grad sees: the last window's gradients

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            state = torch.get_rng_state()  # dropout draws from here: the reference replays it
            seen = self.calls.setdefault(f"{batch_idx}:{idx.tolist()}", [state, 0, True])
            seen[1] += 1  # each micro-batch's step runs once (no recomputation)
            seen[2] = seen[2] and torch.equal(seen[0], state)
            out = self.net(x)
            loss = self.loss(out, y)
            self.log("train_loss", loss, sync_dist=True)  # logged once per step, not once per micro-batch
            self.log("train_epoch", loss, sync_dist=True, on_step=False, on_epoch=True)
            self.log("samples", float(len(idx)), reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True)
            return {"loss": loss, "pred": out.detach()}

        def on_train_batch_start(self, batch, batch_idx):
            self.shares.append(batch[0].tolist())

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.outs.append((outputs["loss"].item(), len(outputs["pred"])))
            if self.first is None:
                self.first = [p.detach().clone() for p in self.net.parameters()]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class WatchedMicroNet(MicroNet):
        """Reads the gradients before Lightning zeroes them: the last window's must still be there."""

        def on_before_zero_grad(self, optimizer):
            if any(p.grad is not None for p in self.net.parameters()):  # not before the first step
                self.before_zero.append([p.grad.sum().item() for p in self.net.parameters()])

    def micro_scenario(make, loss, X, Y, devices, micro, accumulate=1, watch=True, **strategy) -> dict:
        """A plan whose shares run as ``micro`` against one float64 process running each micro-batch in turn.

        ``watch``: the module has an ``on_before_zero_grad`` (the strategy then keeps the last window's
        gradients beside the micro-batches'; without one it drops them as the step starts).
        """
        L.seed_everything(0)
        model = (WatchedMicroNet if watch else MicroNet)(make(), loss)
        ref = copy.deepcopy(model.net)
        plan = hetsplit.Plan(["rank0", "rank1"], [sum(m) for m in micro], [0.0, 0.0], 8, micro_batches=micro)
        t = trainer(
            HeteroDDPStrategy(devices=devices, plan=plan, **strategy), limit_val_batches=0,
            accumulate_grad_batches=accumulate,
        )  # fmt: skip
        t.fit(model, DataLoader(TensorDataset(torch.arange(N), X, Y), batch_size=BATCH, shuffle=True))
        calls, shares = gathered(model.calls), gathered(model.shares)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        losses, share_losses, first, before_zero = [], [], None, []
        steps = len(shares[0])
        for k in range(steps):
            if k % accumulate == 0:
                if k and watch:
                    before_zero.append([p.grad.sum().item() for p in ref.parameters()])
                opt.zero_grad()
            parts = [torch.tensor(shares[r][k], dtype=torch.long).split(micro[r]) for r in range(2)]
            terms, total = [[], []], 0.0
            start = [b.clone() for b in ref.buffers()]  # DDP broadcasts rank 0's buffers in each step's first forward
            for r in range(2):
                for b, old in zip(ref.buffers(), start):  # every rank starts the step from them
                    b.copy_(old)
                for p in parts[r]:  # each micro-batch reads the buffers the one before it left
                    torch.set_rng_state(calls[r][f"{k}:{p.tolist()}"][0])  # the masks that rank drew
                    terms[r].append(loss(ref(X[p]), Y[p]) * len(p))
                if r == 0:
                    kept = [b.clone() for b in ref.buffers()]
                part = sum(terms[r]) / 8 / accumulate  # Lightning divides the loss by accumulate_grad_batches
                part.backward()  # before the next rank's buffers are set (BatchNorm's backward holds them)
                total += part.item()
            for b, old in zip(ref.buffers(), kept):  # rank 0's, as its forwards left them, go on to the next step
                b.copy_(old)
            if k % accumulate == accumulate - 1 or k == steps - 1:
                opt.step()
            losses.append(total * accumulate)
            share_losses.append(sum(terms[rank]).item() / sum(micro[rank]))
            first = first or [p.detach().clone() for p in ref.parameters()]
        diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))
        metrics = {k: float(v) for k, v in t.callback_metrics.items()}
        return {
            "first_step_diff": diff(model.first, first),
            "final_diff": diff(list(model.net.parameters()), list(ref.parameters())),
            "buffer_diff": diff(list(model.net.buffers()), list(ref.buffers())) if list(ref.buffers()) else 0.0,
            "train_loss": metrics["train_loss"],
            "train_loss_ref": losses[-1],
            "train_epoch": metrics["train_epoch"],
            "train_epoch_ref": sum(losses) / len(losses),
            "samples": metrics["samples"],
            "calls": sorted({c[1] for c in model.calls.values()}),
            "same_state": all(c[2] for c in model.calls.values()),
            "outs": [(loss * accumulate, rows) for loss, rows in model.outs],  # Lightning's is divided by it
            "share_losses": share_losses,
            "shares": [len(s) for s in model.shares],
            "before_zero_diff": max(
                (abs(a - b) for got, want in zip(model.before_zero, before_zero) for a, b in zip(got, want)),
                default=0.0,
            ),
            "before_zero_count": [len(model.before_zero), len(before_zero)],
        }

    res: dict = {}
    # Bad input: one clear error on every rank, before the process group exists.
    res["bad_devices"] = error(lambda: trainer(HeteroDDPStrategy(devices="cpu,cpu,cpu")).fit(Net(), *loaders()))
    bad_plan = plan_from_sizes(None, ["a", "b", "c"], [4, 2, 2])
    res["bad_plan"] = error(lambda: trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=bad_plan)).fit(Net()))
    res["group_before"] = dist.is_available() and dist.is_initialized()

    ckpt = str(out / "epoch1.ckpt")
    res["ddp_sampler"] = scenario([6, 2], save=ckpt, use_distributed_sampler=True)
    res["own_sampler"] = scenario([6, 2], use_distributed_sampler=False, strategy={"weighting": "outputs"})
    res["zero_share"] = scenario([8, 0])
    res["small_share"] = scenario([7, 1])  # the last 4 samples are cut [4, 0]: rank 1 runs a stand-in there
    quick = {"time_budget": 0.5, "batch_sizes": [2, 4], "repeats": 1, "warmup": 1, "calibrate": 1}
    res["profiled"] = scenario(None, strategy={"plan_kwargs": quick})
    # Re-solve after every step, moving at most 1 sample at once: the shares may change, never to 0.
    eager = hetsplit.Rebalancer(every=1, threshold=0.0, window=1, max_move=0.125)
    res["rebalanced"] = scenario([5, 3], strategy={"rebalance": eager})
    # The split report over two epochs, each ending in a validation: the split is said once; the measured
    # step is the median of the steps run less the first (warm-up), no epoch's end or validation timed.
    L.seed_everything(0)
    two = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    with contextlib.redirect_stdout(io.StringIO()) as said:
        trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=two), max_epochs=2).fit(Net(), *loaders())
    res["report"] = [line for line in said.getvalue().splitlines() if line.startswith("hetsplit:")]
    # The package's files one training step enters (hooks, training_step, backward, optimizer step), traced
    # after warm-up (the second epoch's second step): per-step questions are answered at setup, not here.
    package = str(Path(hetsplit.__file__).parent)

    class StepFiles(L.Callback):
        def __init__(self) -> None:
            self.files: set[str] = set()

        def _enter(self, frame, event, arg) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(package):
                self.files.add(os.path.relpath(frame.f_code.co_filename, package))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 1:
                sys.setprofile(self._enter)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sys.setprofile(None)

    class Plain(Net):  # without Net's own questions to the sampler
        def training_step(self, batch, batch_idx):
            _, x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

    L.seed_everything(0)
    traced = StepFiles()
    trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=two, quiet=True), max_epochs=2, callbacks=[traced]).fit(
        Plain(), loaders()[0]
    )
    res["step_files"] = sorted(traced.files)
    # Micro-batched shares within emulated memory caps (a forward on more samples runs out of memory).
    mlp = lambda: torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    res["micro"] = micro_scenario(mlp, F.mse_loss, X, Y, "cpu:max2,cpu:max1", [[2, 2, 2], [1, 1]])
    torch.manual_seed(1)
    images, labels = torch.randn(N, 3, 48, 48, dtype=torch.float64), torch.randint(0, 2, (N,))
    vision = lambda: mobilenet_v3_small(num_classes=2).double()  # BatchNorm, dropout, squeeze-excite
    res["micro_vision"] = micro_scenario(
        vision, F.cross_entropy, images, labels, "cpu:max2,cpu@1", [[2, 2, 2], [2]], watch=False, weighting="outputs"
    )
    # A buffer the training forward reads and updates: spectral norm's power-iteration vectors.
    spectral = lambda: torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 8)), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    res["micro_buffers"] = micro_scenario(spectral, F.mse_loss, X, Y, "cpu:max2,cpu@1", [[2, 2, 2], [2]])
    # Lightning's gradient accumulation over micro-batched shares; on_before_zero_grad reads the last window's
    # gradients, so the micro-batches' gradients wait beside them (not dropped early).
    res["micro_accumulate"] = micro_scenario(mlp, F.mse_loss, X, Y, "cpu:max2,cpu:max1", [[2, 2, 2], [1, 1]], 2)
    # The same without the hook: the last window's gradients are dropped as the window's first step starts.
    res["micro_accumulate_unwatched"] = micro_scenario(
        mlp, F.mse_loss, X, Y, "cpu:max2,cpu:max1", [[2, 2, 2], [1, 1]], 2, watch=False
    )

    # Resume the first scenario's checkpoint for a second epoch.
    L.seed_everything(0)
    model = Net()
    t = trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan_from_sizes(None, ["r0", "r1"], [6, 2])), max_epochs=2)
    t.fit(model, *loaders(), ckpt_path=ckpt)
    res["resumed"] = {"global_step": t.global_step, "epoch": t.current_epoch, "order": gathered(model.seen)}
    # trainer.validate alone: the evaluation shares follow the plan, the synced mean is the global one.
    model.val_seen = []
    metrics = t.validate(model, loaders()[1], verbose=False)[0]
    val = torch.cat([torch.tensor(v, dtype=torch.long) for s in gathered(model.val_seen) for v in s])
    with torch.no_grad():
        ref = F.mse_loss(model(X[val]), Y[val]).item()
    res["validate"] = {"sizes": [len(v) for v in model.val_seen], "val_loss": metrics["val_loss"], "ref": ref}
    # An odd number of evaluation samples (19: 15 + 4 here), so the synced count is not a whole mean.
    model.val_seen = []
    odd = DataLoader(TensorDataset(*data[:19]), batch_size=BATCH)
    metrics = t.validate(model, odd, verbose=False)[0]
    with torch.no_grad():
        ref = F.mse_loss(model(X[:19]), Y[:19]).item()
    seen = sorted(i for s in gathered(model.val_seen) for v in s for i in v)
    res["validate_odd"] = {"seen": seen, "val_loss": metrics["val_loss"], "ref": ref}

    # A training loader hetsplit cannot shard: one error on every rank, before any step.
    batches = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), BATCH, False))
    res["bad_loader"] = error(lambda: trainer(HeteroDDPStrategy(devices="cpu,cpu@1")).fit(Net(), batches))
    stream = DataLoader(Stream(), batch_size=BATCH)
    res["iterable"] = error(lambda: trainer(HeteroDDPStrategy(devices="cpu,cpu@1")).fit(Net(), stream))
    # Rebalancing a plan with micro-batches: one error on every rank, before any step (SyncBatchNorm with
    # uneven micro-batch counts is refused there too, but DDP refuses it on a CPU first: tested below).
    model = Net()
    uneven = hetsplit.Plan(["rank0", "rank1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    given = lambda: trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=uneven, rebalance=2)).fit(model, *loaders())
    res["micro_rebalance"] = {"error": error(given), "steps": len(model.seen)}  # refused by the constructor
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()


# --------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    # One launch for the DDP strategy's job and then the FSDP2 strategy's scenarios
    # (tests/lightning_fsdp_job.py, in the same two processes): Lightning's start-up is
    # most of a launch's time. PYTHONPATH: the ranks import this checkout's hetsplit.
    out = tmp_path_factory.mktemp("lightning")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=root)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env), out


@pytest.fixture(scope="module")
def job(launch) -> list[dict]:
    res, out = launch
    files = [out / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), res.stdout[-3000:] + res.stderr[-5000:]
    return [json.loads(f.read_text()) for f in files]


SCENARIOS = ["ddp_sampler", "own_sampler", "zero_share", "small_share", "profiled", "rebalanced"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_steps_equal_full_batch_sgd(job, name):
    for r in job:
        assert r[name]["first_step_diff"] < 1e-12, r[name]["first_step_diff"]
        assert r[name]["final_diff"] < 1e-12, r[name]["final_diff"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_steps_per_epoch_are_the_global_count_every_sample_seen(job, name):
    for r in job:
        assert r[name]["global_step"] == r[name]["steps_run"] == r[name]["loader_len"] == math.ceil(N / 8)
        assert r[name]["covered"] == list(range(N))  # not re-sharded by Lightning's DistributedSampler


@pytest.mark.parametrize(("name", "sizes"), [("ddp_sampler", [6, 2]), ("own_sampler", [6, 2]), ("zero_share", [8, 0])])
def test_batch_sizes_follow_the_plan(job, name, sizes):
    from hetsplit.planning.plan import sizes_from_weights

    # The last global batch is what is left (4 of 8), cut in proportion: nothing added in
    # training or evaluation; a share of 0 is two samples, weighted 0.
    last = sizes_from_weights(N % (2 * BATCH), sizes)
    for rank, r in enumerate(job):
        assert r[name]["sizes"] == [sizes[rank] or 2] * 2 + [last[rank] or 2]
        assert r[name]["val_sizes"] == [sizes[rank] or 2] * 2 + [last[rank] or 2]
    assert sum(sizes) * 2 + sum(last) == N


def test_profiled_plan_is_one_plan(job):
    plans = [r["profiled"]["plan"] for r in job]
    assert plans[0] == plans[1] and sum(plans[0]) == 8
    from hetsplit.planning.plan import sizes_from_weights

    last = sizes_from_weights(N % 8, plans[0])  # the short last global batch, in proportion
    assert [r["profiled"]["sizes"] for r in job] == [[plans[0][r] or 2] * 2 + [last[r] or 2] for r in (0, 1)]


def test_rebalancing_keeps_steps_exact(job):
    per_step = [a + b for a, b in zip(job[0]["rebalanced"]["sizes"], job[1]["rebalanced"]["sizes"])]
    assert per_step == [8, 8, 8]  # every step is the whole global batch, whatever the shares became
    assert job[0]["rebalanced"]["changes"] == job[1]["rebalanced"]["changes"]
    from hetsplit.planning.plan import sizes_from_weights

    final = job[0]["rebalanced"]["plan"]
    last = sizes_from_weights(N % (2 * BATCH), final)  # what is left of the evaluation set, in proportion
    # A share of 0 of the last batch is served two samples that count for nothing.
    assert [r["rebalanced"]["val_sizes"] for r in job] == [[final[r] or 2] * 2 + [last[r] or 2] for r in (0, 1)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_synced_metrics_are_global_batch_means(job, name):
    for r in job:
        s = r[name]
        assert s["train_loss"] == pytest.approx(s["train_loss_ref"], rel=1e-9, abs=1e-12)  # on_step: weighted here
        assert s["train_epoch"] == pytest.approx(s["train_epoch_ref"], rel=1e-9, abs=1e-12)
        assert s["val_loss"] == pytest.approx(s["val_loss_ref"], rel=1e-9, abs=1e-12)
    s = job[0]["ddp_sampler"]
    assert abs(s["train_loss_plain"] - s["train_loss_ref"]) > 1e-6  # the plain mean of rank means would differ


def test_the_split_is_said_once_and_the_measured_step_leaves_out_warm_up_and_epoch_ends(job):
    lines = job[0]["report"]  # rank 0; 3 steps an epoch, 2 timed start to start in each
    assert len(lines) == 2 and "HeteroDDPStrategy: global batch 8 split rank0:cpu 6 (75%" in lines[0], lines
    assert "measured step" in lines[1] and "(median of 3 after 1 warm-up, rank 0, start to start)" in lines[1], lines
    assert job[1]["report"] == [], job[1]["report"]


def test_a_training_step_enters_at_most_ten_of_the_package_files(job):
    # rank 0 runs on "cpu", rank 1 on an emulated "cpu@1" (its throttle enters hetsplit.emulation too).
    for r in job:
        assert r["step_files"] and len(r["step_files"]) <= 10, r["step_files"]


def test_checkpoint_resumes_for_a_second_epoch(job):
    for r in job:
        assert r["resumed"]["global_step"] == 6 and r["resumed"]["epoch"] == 2
        assert r["resumed"]["order"] != r["ddp_sampler"]["order"]  # epoch 2 is shuffled differently
        assert sorted({i for rank in r["resumed"]["order"] for s in rank for i in s}) == list(range(N))


def test_validate_alone_uses_the_plan_shares(job):
    for rank, r in enumerate(job):
        assert r["validate"]["sizes"] == [[6, 6, 3], [2, 2, 1]][rank]  # 20 samples: nothing added
        assert r["validate"]["val_loss"] == pytest.approx(r["validate"]["ref"], rel=1e-9, abs=1e-12)
        odd = r["validate_odd"]  # an odd total (Lightning's integer mean of the count truncated it: 21/20 too large)
        assert odd["seen"] == list(range(19)) and odd["val_loss"] == pytest.approx(odd["ref"], rel=1e-9, abs=1e-12)


def test_bad_input_is_one_clear_error_on_every_rank(job):
    for r in job:
        assert "3 devices" in r["bad_devices"] and "2 processes" in r["bad_devices"]
        assert "3 shares" in r["bad_plan"] and "2 processes" in r["bad_plan"]
        assert not r["group_before"]  # raised before the process group was created
        assert "no batch_size" in r["bad_loader"] and "training loader" in r["bad_loader"]
        assert "dataset Stream is iterable" in r["iterable"]


# An MLP with dropout (both ranks split); mobilenet_v3_small, weighting="outputs"; an MLP with a spectral norm;
# the MLP under Lightning's gradient accumulation (2 batches), with an on_before_zero_grad reading the gradients
# and without one. The MLPs and the spectral norm have that hook; mobilenet and the unwatched MLP do not.
MICRO = ["micro", "micro_vision", "micro_buffers", "micro_accumulate", "micro_accumulate_unwatched"]


@pytest.mark.parametrize("name", MICRO)
def test_micro_batched_shares_equal_full_batch_sgd(job, name):
    for rank, r in enumerate(job):
        s = r[name]
        assert s["first_step_diff"] < 1e-12 and s["final_diff"] < 1e-12, (s["first_step_diff"], s["final_diff"])
        assert s["shares"] == [[6, 2][rank]] * 3  # Lightning hands each rank its share; the strategy cuts it
        assert s["calls"] == [1]  # every micro-batch's training_step runs once: no recomputation
        # what on_before_zero_grad saw: the last window's gradients (the micro-batches' set aside meanwhile)
        assert s["before_zero_diff"] < 1e-12 and s["before_zero_count"][0] == s["before_zero_count"][1]
    # Buffers are updated once per forward, as one process running the micro-batches in turn updates them
    # (BatchNorm's running statistics, the spectral norm's vectors).
    assert job[0][name]["buffer_diff"] < 1e-12


@pytest.mark.parametrize("name", MICRO)
def test_micro_batched_step_logs_and_returns_the_share(job, name):
    for r in job:
        s = r[name]
        assert s["train_loss"] == pytest.approx(s["train_loss_ref"], rel=1e-9, abs=1e-12)  # once per step, synced
        assert s["train_epoch"] == pytest.approx(s["train_epoch_ref"], rel=1e-9, abs=1e-12)
        assert s["samples"] == 24  # reduce_fx="sum": each step's micro-batches summed (3 steps of 8)
        assert [rows for _, rows in s["outs"]] == s["shares"]  # per-sample outputs concatenated in order
        assert [loss for loss, _ in s["outs"]] == pytest.approx(s["share_losses"], rel=1e-9, abs=1e-12)


def test_rebalancing_a_micro_batched_plan_is_refused_before_any_step(job):
    for r in job:
        assert r["micro_rebalance"]["steps"] == 0
        message = r["micro_rebalance"]["error"]
        assert "rebalance=2" in message and "share 6 into micro-batches [2, 2, 2]" in message
        assert "Pass rebalance=0" in message and "without accumulate" in message


def test_micro_batch_refusals_and_memory_caps():
    from types import SimpleNamespace

    from lightning.pytorch.plugins import TorchSyncBatchNorm

    import hetsplit
    from hetsplit.integrations.lightning.checks import check_micro_plan
    from hetsplit.integrations.lightning.micro_batches import (
        GradientsAside,
        combine,
        run_training_step,
        share_micro_batches,
        share_output,
    )

    micro = hetsplit.Plan(["r0", "r1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    manual = SimpleNamespace(automatic_optimization=False, device=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"rank 0's share 6 into micro-batches \[2, 2, 2\].*use automatic optimization"
    ):
        share_micro_batches(micro, 1, manual)  # every rank refuses, also one whose own share runs whole
    # SyncBatchNorm, as Trainer(sync_batchnorm=True) makes it: its collectives must match across ranks.
    sync = TorchSyncBatchNorm().apply(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    with pytest.raises(
        ValueError, match=r"SyncBatchNorm \(1, .*the ranks run \[3, 1\] micro-batches.*without micro.*same number"
    ):
        check_micro_plan(micro, sync, 0)
    with pytest.raises(ValueError, match=r"rebalance=Rebalancer\(every=3\)\) with a plan with micro-batches"):
        check_micro_plan(micro, torch.nn.Linear(3, 4), hetsplit.Rebalancer(every=3))
    even = hetsplit.Plan(["r0", "r1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[3, 3], [1, 1]])
    check_micro_plan(even, sync, 0)  # as many micro-batches on every rank: SyncBatchNorm's collectives match
    check_micro_plan(hetsplit.Plan(["r0", "r1"], [6, 2], [0.0, 0.0], 8), sync, 5)  # no micro-batches
    with pytest.raises(ValueError, match=r"returned NoneType for micro-batch 2 of 3 \(2 samples\)"):
        share_output([torch.ones((), requires_grad=True), None, torch.ones(())], [2, 2, 2])

    def strategy(plan, device):
        trainer = SimpleNamespace(accumulate_grad_batches=1, callbacks=[])
        module = SimpleNamespace(automatic_optimization=True, device=torch.device("cpu"), trainer=trainer)
        module.parameters = lambda: []
        context = SimpleNamespace(train_step_context=lambda: contextlib.nullcontext())
        return SimpleNamespace(
            module=module, plan=plan, global_rank=0, rank_device=parse_device(device),
            model=None, precision_plugin=context, aside=GradientsAside(), micro_model=lambda: None,
        )  # fmt: skip

    whole = hetsplit.Plan(["r0", "r1"], [6, 2], [0.0, 0.0], 8)
    batch = (torch.zeros(6, 3), torch.zeros(6))
    with pytest.raises(torch.OutOfMemoryError, match="a forward on 6 samples, but its emulated memory holds 4"):
        run_training_step(strategy(whole, "cpu:max4"), lambda *a: "ran", (batch, 0), {})
    assert run_training_step(strategy(whole, "cpu:max6"), lambda *a: "ran", (batch, 0), {}) == "ran"
    with pytest.raises(torch.OutOfMemoryError, match="a forward on 2 samples, but its emulated memory holds 1"):
        run_training_step(strategy(micro, "cpu:max1"), lambda *a: "ran", (batch, 0), {})  # each micro-batch checked

    # How the share's values come from its micro-batches' (logged values, extra outputs).
    assert combine([1.0, 4.0], [1, 2]) == 3.0 and combine([1, 4], [1, 2], "sum") == 5
    assert combine([torch.tensor(1.0), torch.tensor(3.0)], [3, 1], "max").item() == 3.0
    assert combine([torch.tensor(1.0), 3.0], [3, 1]).item() == 1.5
    assert combine([torch.zeros(2, 3), torch.ones(1, 3)], [2, 1], rows=True).shape == (3, 3)
    assert combine([{"a": 1.0, "b": "x"}, {"a": 3.0, "b": "y"}], [1, 1]) == {"a": 2.0, "b": "y"}
    loss = share_output([torch.tensor(1.0, requires_grad=True), torch.tensor(4.0, requires_grad=True)], [2, 1])
    assert loss.item() == pytest.approx(2.0)


def test_constructor_rejects_bad_arguments():
    from hetsplit.lightning import HeteroDDPStrategy
    from hetsplit.planning import Plan, plan_from_sizes

    with pytest.raises(ValueError, match="weighting='mean'"):
        HeteroDDPStrategy(weighting="mean")
    with pytest.raises(ValueError, match="rebalance=-1"):
        HeteroDDPStrategy(rebalance=-1)
    with pytest.raises(ValueError, match="global_batch_size=16 but the plan splits 8"):
        HeteroDDPStrategy(plan=plan_from_sizes(None, ["a", "b"], [6, 2]), global_batch_size=16)
    HeteroDDPStrategy(plan=Plan(["a", "b"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]]))  # followed


def test_one_options_object_carries_the_arguments_every_integration_shares():
    import dataclasses

    from hetsplit.accelerate import HeteroAccelerator
    from hetsplit.integrations.options import HeteroOptions
    from hetsplit.lightning import HeteroDDPStrategy, HeteroModelParallelStrategy
    from hetsplit.planning import plan_from_sizes

    plan = plan_from_sizes(None, ["a", "b"], [6, 2])
    options = HeteroOptions(devices=["cpu", "cpu@0.25"], plan=plan, rebalance=3, plan_kwargs={"calibrate": 0})
    for strategy in (HeteroDDPStrategy(options=options), HeteroModelParallelStrategy(options=options)):
        assert strategy.options is options and strategy.plan is plan and strategy.rebalance == 3
        assert strategy.device_list == "cpu,cpu@0.25" and strategy.plan_kwargs == {"time_budget": 10.0, "calibrate": 0}
    keywords = HeteroDDPStrategy(devices=["cpu", "cpu@0.25"], plan=plan, rebalance=3, plan_kwargs={"calibrate": 0})
    assert keywords.options == options  # the keywords and the object are one thing inside
    assert HeteroAccelerator(options=HeteroOptions(plan_kwargs={"weights": [1]})).plan_kwargs["weights"] == [1]
    # Checked as the keywords are, naming the class the user made; never both ways at once.
    with pytest.raises(ValueError, match=r"HeteroDDPStrategy\(rebalance=-1\)"):
        HeteroDDPStrategy(options=dataclasses.replace(options, rebalance=-1))
    with pytest.raises(TypeError, match=r"HeteroDDPStrategy: options= and quiet= both given"):
        HeteroDDPStrategy(options=options, quiet=True)
    with pytest.raises(TypeError, match=r"HeteroModelParallelStrategy\(options=...\) must be a HeteroOptions"):
        HeteroModelParallelStrategy(options={"devices": "cpu,cpu"})


# --------------------------------------------------------------------------- FSDP2: HeteroModelParallelStrategy
# Its scenarios run in the same launch, after the DDP job (tests/lightning_fsdp_job.py): the parameters
# after two epochs equal one plain process's full-batch SGD on the same global batches; a resumed fit
# ends as the uninterrupted one; setup refuses a model without one fully_shard root holding every
# trainable parameter. The constructor's refusals need no launch.


@pytest.mark.parametrize("name", ["uneven", "zero", "micro", "profiled"])
def test_fsdp2_steps_equal_full_batch_sgd(launch, name):
    check(launch[0], name)


def test_fsdp2_rebalancing_changes_the_shares_and_keeps_every_step_exact(launch):
    check(launch[0], "rebalanced")


def test_fsdp2_resumed_checkpoint_ends_as_the_uninterrupted_fit(launch):
    check(launch[0], "resumed")


@pytest.mark.parametrize("name", ["sharded_nothing", "several_roots", "outside_root"])
def test_fsdp2_setup_refuses_a_model_without_one_root_holding_every_parameter(launch, name):
    check(launch[0], name)


# --------------------------------------------------------------------------- the global random stream
# tests/lightning_rng_job.py, last in the same launch: a module drawing from torch's global generator in
# its hooks (on_train_start, training_step, ...) draws what it draws under plain DDPStrategy /
# ModelParallelStrategy, with a plan, hand-set weights or a profiled plan.


@pytest.mark.parametrize("name", ["rng_ddp", "rng_model_parallel"])
def test_hooks_see_the_random_stream_of_plain_lightning(launch, name):
    check(launch[0], name)


# --------------------------------------------------------------------------- upstream scripts' patterns
# tests/integration_jobs.py's Lightning scenarios, last in the same launch: a zero share never reaches
# training_step empty, sync_dist metrics cover the 500 samples once, steps without batch_idx are profiled
# and weighted, a zero share logs no NaN without sync_dist.


@pytest.mark.parametrize("name", LIGHTNING_PATTERNS)
def test_an_upstream_script_pattern_matches_plain_lightning(launch, name):
    check(launch[0], name)


def test_fsdp2_only_data_parallelism_on_a_1d_mesh():
    from hetsplit.lightning import HeteroModelParallelStrategy

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\).*use tensor_parallel_size=1"):
        HeteroModelParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=0\)"):
        HeteroModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"HeteroModelParallelStrategy\(weighting='hook'\)"):
        HeteroModelParallelStrategy(weighting="hook")


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
    # The FSDP2 strategy's scenarios, in these processes and their process group.
    import runpy

    sys.argv = sys.argv[:1]  # every scenario of the job
    runpy.run_path(str(Path(__file__).with_name("lightning_fsdp_job.py")), run_name="__main__")
    runpy.run_path(str(Path(__file__).with_name("lightning_rng_job.py")), run_name="__main__")
    # Last, tests/integration_jobs.py's Lightning patterns (upstream scripts' ways), in the same processes.
    from integration_launch import LIGHTNING_PATTERNS, run_patterns

    run_patterns(LIGHTNING_PATTERNS)
