"""Upstream-script patterns for two-process jobs: tests/test_integration_scenarios.py launches the Trainer's
and torchrun's; the accelerate and Lightning ones run inside those frameworks' own jobs (``run_patterns``).

``torchrun --standalone --nproc_per_node=2 tests/integration_jobs.py SCENARIO...`` runs the
scenarios, in turn, on both ranks (gloo, one thread each) and prints ``OK SCENARIO rank R`` once its
asserts pass on that rank. Each scenario is an upstream-script pattern (a tokenizer batch
moved with ``.to()``, ``x.view(x.size(0), -1)``, ``cpu=False`` on a CPU-only machine, a
metric synced over 500 samples, a resumed run), checked against a single-process float64
reference: "equal" means to rounding (1e-12).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
N = 16
X = torch.randn(N, 3, dtype=torch.float64)
Y = torch.randn(N, 1, dtype=torch.float64)
DATA = TensorDataset(torch.arange(N), X, Y)
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def plan(*sizes):
    from hetsplit.planning import plan_from_sizes

    return plan_from_sizes(None, [f"rank{r}" for r in range(len(sizes))], list(sizes))


def sgd_reference(model, global_batches, lr=0.1):
    """Plain full-batch SGD on the given global batches (indices into X, Y), one step each."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for idx in global_batches:
        opt.zero_grad()
        F.mse_loss(model(X[idx]), Y[idx]).backward()
        opt.step()
    return model


def assert_same(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach().cpu() - q.detach()).abs().max().item()
        assert err < 1e-12, f"{what}: parameter {name} differs from the single-process reference by {err}"


def gathered(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- accelerate
class Tokenized(dict):
    """A batch as a tokenizer's collate makes it (transformers' BatchEncoding): a dict with ``.to()``."""

    def to(self, device):
        return Tokenized({k: v.to(device) for k, v in self.items()})


def tokenizer_collate(items):
    idx, x, y = zip(*items)
    return Tokenized(idx=torch.stack(idx), x=torch.stack(x), y=torch.stack(y))


@scenario
def accelerate_zero_share_batch_keeps_its_type():
    # nlp_example.py: `batch.to(accelerator.device)` on what the collate function made; the
    # process the plan gives 0 gets two real samples of that type, weighted 0.
    from hetsplit.accelerate import HeteroAccelerator

    acc = HeteroAccelerator(plan=plan(8, 0))
    model, ref = net(), net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(DATA, batch_size=4, shuffle=True, collate_fn=tokenizer_collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches, seen = [], []
    for batch in loader:
        batch = batch.to(acc.device)
        assert isinstance(batch, Tokenized) and len(batch["idx"]) == [8, 2][acc.process_index], batch
        acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        opt.step()
        opt.zero_grad()
        real = acc.gather_for_metrics(batch["idx"])
        batches.append(real)
        seen.append(real)
    assert sorted(torch.cat(seen).tolist()) == list(range(N)), seen  # every sample once, the filler left out
    assert_same(model.module, sgd_reference(ref, batches), "zero share")


@scenario
def accelerate_cpu_false_on_a_cpu_only_machine_is_one_job():
    # Upstream scripts pass cpu=args.cpu (False): still one two-process CPU job, not two copies.
    from hetsplit.accelerate import HeteroAccelerator

    acc = HeteroAccelerator(devices="cpu,cpu@1", plan=plan(6, 2), cpu=False)
    assert acc.num_processes == 2 and acc.process_index == dist.get_rank(), (acc.num_processes, acc.distributed_type)


@scenario
def accelerate_profiles_on_the_device_accelerate_names():
    # No device list (torchrun or accelerate launch alone): accelerate's device is "cpu:0",
    # which hetsplit reads as the CPU and profiles there.
    from hetsplit.accelerate import HeteroAccelerator

    os.environ.pop("HETSPLIT_DEVICES", None)
    budget = {"time_budget": 0.3, "batch_sizes": [1, 2, 4], "calibrate": 0}
    acc = HeteroAccelerator(loss_fn=F.mse_loss, plan_kwargs=budget)
    acc.prepare(net(), DataLoader(TensorDataset(X, Y), batch_size=4))
    assert sum(acc.plan.sizes) == 8 and gathered(acc.plan.sizes)[0] == acc.plan.sizes, acc.plan


@scenario
def accelerate_resume_draws_the_orders_of_an_uninterrupted_run():
    # complete_nlp_example.py: save_state mid-epoch, then a new run load_state's it, resumes the
    # epoch with skip_first_batches and goes on; its later epochs are the uninterrupted run's.
    from accelerate.utils import set_seed

    from hetsplit.accelerate import HeteroAccelerator

    data = TensorDataset(torch.arange(40))

    def order(loader, skip=0):
        active = acc.skip_first_batches(loader, skip) if skip else loader
        return [acc.gather(idx).tolist() for (idx,) in active]

    set_seed(0)
    acc = HeteroAccelerator(plan=plan(5, 3))
    folder = gathered(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]
    loader = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
    uninterrupted = [order(loader)]
    for step, _ in enumerate(loader):  # epoch 1, checkpointed after its first step
        if step == 0:
            acc.save_state(folder)
    uninterrupted += [order(loader), order(loader)]  # epochs 2 and 3

    set_seed(0)
    acc = HeteroAccelerator(plan=plan(5, 3))
    loader = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
    acc.load_state(folder)
    rest = order(loader, skip=1)
    resumed = [order(loader), order(loader)]
    assert resumed == uninterrupted[1:], (resumed, uninterrupted)
    assert rest and all(batch not in uninterrupted[0] for batch in rest), (rest, uninterrupted[0])


@scenario
def torchrun_weights_split_every_global_batch_in_proportion():
    # The course's "80 samples to the fast GPU, 20 to the slow one" on torchrun, with the
    # plan function and through an integration's plan_kwargs.
    import hetsplit.distributed as hd
    from hetsplit.accelerate import HeteroAccelerator

    acc = HeteroAccelerator(devices="cpu,cpu@1", plan_kwargs={"weights": [4, 1]})
    p = hd.plan(net(), X[:4], 100, weights=[4, 1])
    assert list(p.sizes) == [80, 20], p.sizes
    _, loader = acc.prepare(net(), DataLoader(DATA, batch_size=5))
    assert list(acc.plan.sizes) == [8, 2], acc.plan.sizes
    idx, _, _ = next(iter(loader))
    assert len(idx) == [8, 2][acc.process_index]


def ddp_job(sizes):
    """A torchrun job's pieces: the process group, a DDP model and its plain twin, the plan, this rank's loader."""
    from torch.nn.parallel import DistributedDataParallel

    import hetsplit.distributed as hd

    if not dist.is_initialized():
        hd.init(devices="cpu,cpu@1")
    model = net()
    p = plan(*sizes)
    return DistributedDataParallel(model), model, net(), p, hd.data_loader(DATA, p, shuffle=False)


@scenario
def torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out():
    # weight_gradients(ddp) without a plan weights each step by its real samples: the two samples
    # data_loader serves a share of 0 are not (they counted before, extra samples in the mean).
    import hetsplit.distributed as hd

    ddp, model, ref, _, loader = ddp_job((8, 0))
    hd.weight_gradients(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for idx, x, y in loader:
        assert len(idx) == [8, 2][dist.get_rank()], idx  # the stand-in: two real samples
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        batches.append(torch.tensor(gathered(idx.tolist())[0]))  # rank 0's rows: the global batch
    assert_same(model, sgd_reference(ref, batches), "weight_gradients without a plan, a zero share")


@scenario
def torchrun_rebalancer_does_not_time_a_zero_shares_stand_in():
    # The rank the plan gives 0 runs one stand-in sample each step; its time is no measurement of its
    # speed (0 samples in t seconds), so the rebalancer records none for it, and steps stay exact.
    import hetsplit.distributed as hd
    from hetsplit import Rebalancer

    ddp, model, ref, p, loader = ddp_job((8, 0))
    state = hd.weight_gradients(ddp, p)
    policy = Rebalancer(every=1, threshold=0.0, window=1)
    rb = hd.DistributedRebalancer(p, policy, sampler=loader.batch_sampler, gradients=state, model=ddp, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for epoch in range(3):
        loader.batch_sampler.set_epoch(epoch)
        for idx, x, y in loader:
            with rb.step():
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
            opt.step()
            batches.append(torch.tensor(gathered(idx.tolist())[0]))
    assert rb.steps == 6 and "rank1" not in policy.log_factors and "rank1" not in policy.corrections, policy.factors()
    assert "rank0" in policy.log_factors and list(rb.plan.sizes) == [8, 0], (policy.factors(), rb.plan)
    assert_same(model, sgd_reference(ref, batches), "rebalanced steps with a zero share")


# ----------------------------------------------------------------------------- the HF Trainer
@scenario
def trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job():
    # run_clm.py leaves use_cpu out: still one two-process CPU job, not two copies.
    from transformers import TrainingArguments

    from hetsplit.transformers import HeteroTrainer

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], per_device_train_batch_size=4)
    # run_clm.py logs "distributed training: ..." from its arguments before the Trainer exists.
    assert args.parallel_mode.value == "distributed" and args.world_size == 2, (args.parallel_mode, args.world_size)
    trainer = HeteroTrainer(model=net(), args=args, devices="cpu,cpu@1", plan=plan(6, 2))
    assert trainer.accelerator.num_processes == 2 and trainer.args.world_size == 2, trainer.accelerator.distributed_type


# ----------------------------------------------------------------------------- Lightning
def lightning_trainer(strategy, **kwargs):
    import lightning as L

    options = {"max_epochs": 1, "enable_progress_bar": False, "logger": False, "enable_checkpointing": False}
    options.update(enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, **options)


def lightning_module(sync_dist=True, batch_idx=True):
    import lightning as L

    class Flat(L.LightningModule):
        """backbone_image_classifier.py's pattern: x.view(x.size(0), -1) before the layers."""

        def __init__(self):
            super().__init__()
            self.layer = net()
            self.seen = []

        def forward(self, x):
            return self.layer(x.view(x.size(0), -1))

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            self.seen.append(idx.tolist())
            loss = F.mse_loss(self(x.unsqueeze(1)), y)
            self.log("train_loss", loss, sync_dist=sync_dist, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            _, x, y = batch
            self.log("val_loss", F.mse_loss(self(x.unsqueeze(1)), y), sync_dist=sync_dist)

        def test_step(self, batch, batch_idx):
            _, x, y = batch
            self.log("test_loss", F.mse_loss(self(x.unsqueeze(1)), y), sync_dist=sync_dist)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class NoIndex(Flat):
        """Lightning's FSDP2 example's pattern: step hooks without batch_idx (Lightning passes what they name)."""

        def training_step(self, batch):
            return super().training_step(batch, None)

        def validation_step(self, batch):
            return super().validation_step(batch, None)

        def test_step(self, batch):
            return super().test_step(batch, None)

    return Flat() if batch_idx else NoIndex()


@scenario
def lightning_zero_share_never_reaches_the_step_empty():
    from hetsplit.lightning import HeteroDDPStrategy

    module = lightning_module()
    strategy = HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan(8, 0))
    trainer = lightning_trainer(strategy)
    trainer.fit(module, DataLoader(DATA, batch_size=4, shuffle=True), DataLoader(DATA, batch_size=4))
    seen = gathered(module.seen)
    assert all(len(i) == 2 for i in seen[1]), seen[1]  # the filler: two real samples a step
    ref = sgd_reference(net(), [torch.tensor(i) for i in seen[0]])
    assert_same(module.layer, ref, "zero share")
    expected = F.mse_loss(ref(X), Y).item()
    got = trainer.callback_metrics["val_loss"].item()
    assert abs(got - expected) < 1e-12, (got, expected)  # the fillers counted nowhere


@scenario
def lightning_sync_dist_metrics_cover_500_samples_once():
    from hetsplit.lightning import HeteroDDPStrategy

    n = 500
    torch.manual_seed(2)
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64)
    data = TensorDataset(torch.arange(n), x, y)
    module = lightning_module()
    strategy = HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan(6, 2))
    trainer = lightning_trainer(strategy)
    with torch.no_grad():
        expected = F.mse_loss(copy.deepcopy(module.layer)(x), y).item()
    got = trainer.validate(module, DataLoader(data, batch_size=32), verbose=False)[0]["val_loss"]
    assert abs(got - expected) < 1e-12, ("val_loss", got, expected)
    got = trainer.test(module, DataLoader(data, batch_size=32), verbose=False)[0]["test_loss"]
    assert abs(got - expected) < 1e-12, ("test_loss", got, expected)


@scenario
def lightning_steps_without_batch_idx_are_profiled_and_weighted():
    # training_step(self, batch): the profiler calls it as Lightning does, and a short last global
    # batch (20 samples, 8 a step: [3, 1] in the last) is weighted by its own rows.
    from hetsplit.lightning import HeteroDDPStrategy

    torch.manual_seed(3)
    n = 20
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64)
    data = TensorDataset(torch.arange(n), x, y)
    quick = {"time_budget": 0.3, "batch_sizes": [1, 2, 4], "calibrate": 0}
    profiled = HeteroDDPStrategy(devices="cpu,cpu@1", plan_kwargs=quick)
    with contextlib.redirect_stdout(io.StringIO()) as said:
        lightning_trainer(profiled).fit(lightning_module(batch_idx=False), DataLoader(data, batch_size=4))
    assert profiled.plan.batch_size == 8 and gathered(profiled.plan.sizes)[0] == profiled.plan.sizes, profiled.plan
    # Rank 0 says the split it chose and its predicted step, then the measured one (3 steps).
    lines = [line for line in said.getvalue().splitlines() if line.startswith("hetsplit: HeteroDDPStrategy:")]
    assert len(lines) == (2 if dist.get_rank() == 0 else 0), lines
    if lines:
        assert "global batch 8 split rank0:cpu " in lines[0] and "; predicted step " in lines[0], lines
        assert "not real hardware): cpu@1" in lines[0], lines
        assert "(median of 1 after 1 warm-up, rank 0, start to start)" in lines[1], lines
    module = lightning_module(batch_idx=False)
    trainer = lightning_trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan(6, 2), quiet=True))
    with contextlib.redirect_stdout(io.StringIO()) as said:
        trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4))
    assert "hetsplit:" not in said.getvalue(), said.getvalue()  # quiet=True
    seen = gathered(module.seen)
    assert [len(i) for i in seen[0]] == [6, 6, 3] and [len(i) for i in seen[1]] == [2, 2, 1], seen
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for a, b in zip(*seen):
        opt.zero_grad()
        F.mse_loss(ref(x[a + b]), y[a + b]).backward()
        opt.step()
    for (name, p), q in zip(module.layer.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err < 1e-12, f"{name} differs from the full-batch reference by {err}"
    expected = F.mse_loss(ref(x), y).item()
    got = trainer.callback_metrics["val_loss"].item()
    assert abs(got - expected) < 1e-12, (got, expected)


@scenario
def lightning_zero_share_logs_no_nan_without_sync_dist():
    # Lightning's own examples log without sync_dist; the rank the plan gives 0 logs its stand-in
    # samples' mean (a plain DDP rank logs its own), never NaN: EarlyStopping runs all epochs.
    import math

    from lightning.pytorch.callbacks import EarlyStopping

    from hetsplit.lightning import HeteroDDPStrategy

    module = lightning_module(sync_dist=False)
    stop = EarlyStopping(monitor="val_loss", patience=3)
    trainer = lightning_trainer(HeteroDDPStrategy(devices="cpu,cpu@1", plan=plan(8, 0)), max_epochs=3, callbacks=[stop])
    trainer.fit(module, DataLoader(DATA, batch_size=4, shuffle=True), DataLoader(DATA, batch_size=4))
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    assert trainer.current_epoch == 3 and not stop.stopped_epoch, (trainer.current_epoch, metrics)
    got = trainer.test(module, DataLoader(DATA, batch_size=4), verbose=False)[0]
    assert all(math.isfinite(v) for v in [*metrics.values(), *got.values()]), (metrics, got)
    assert {"val_loss", "train_loss_epoch", "test_loss"} <= {*metrics, *got}, (metrics, got)


if __name__ == "__main__":
    # Several scenarios of one framework may share a launch (its start-up is most of its
    # time); each prints its own OK line, and the first failure ends the launch.
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        SCENARIOS[name]()
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        print(f"OK {name} rank {rank}", flush=True)
