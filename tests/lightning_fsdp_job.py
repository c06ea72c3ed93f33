"""The FSDP2 half of tests/test_lightning.py's launch: HeteroModelParallelStrategy per scenario.

Run after that module's DDP job in the same two processes (or alone: ``torchrun --standalone
--nproc_per_node=2 tests/lightning_fsdp_job.py [NAME,...]``), it runs every scenario
on both ranks (gloo, one thread each, float64): a LightningModule that shards itself with
``fully_shard`` in ``configure_model`` is trained on uneven shares, and its parameters are
compared with one plain process running full-batch SGD on the same global batches (the
indices each rank saw): "equal" means to rounding (1e-12). Then a fit resumed from a
sharded checkpoint, and the models ``configure_model`` shards wrongly, refused at setup
(last: each refused fit is followed by a collective). Prints ``OK``/``FAIL`` per scenario
and rank (``tests/integration_launch.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from integration_launch import scenario  # tests/ is the script's folder
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
from hetsplit.lightning import HeteroModelParallelStrategy
from hetsplit.planning import plan_from_sizes

N, BATCH = 20, 4  # a global batch of 8 on 2 ranks: 3 steps per epoch, the last one 4 samples
torch.manual_seed(0)
X, Y = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 1, dtype=torch.float64)
DATA = TensorDataset(torch.arange(N), X, Y)
RANK = int(os.environ["RANK"])


def net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


class Sharded(L.LightningModule):
    """A model sharded as Lightning's FSDP2 guide does it: each layer, then the model holding them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = net()
        self.shares: list[list[int]] = []  # per training step: the indices of this rank's share
        self.stand_in: list[bool] = []  # per step: the share is a zero share's one stand-in sample

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.shares.append(batch[0].tolist())
        self.stand_in.append(self.trainer.strategy.train_sampler.is_filler(batch_idx))

    def validation_step(self, batch, batch_idx):  # a collective forward on every rank, as many on each
        _, x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plan_of(*sizes):
    return plan_from_sizes(None, ["rank0", "rank1"], list(sizes))


def gathered(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fit(strategy, epochs=2, module=Sharded, ckpt_path=None, **options):
    L.seed_everything(0)
    model = module()
    options = {"enable_checkpointing": False, **options}
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, enable_progress_bar=False,
        logger=False, enable_model_summary=False, **options,
    )  # fmt: skip
    loader = DataLoader(DATA, batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, DataLoader(DATA, batch_size=BATCH), ckpt_path=ckpt_path)
    return model, trainer


def assert_full_batch_sgd(model, trainer, padded=False, epochs=2):
    """Every step equals one plain process's full-batch SGD step on the global batch the ranks ran.

    ``padded``: the last global batch is filled up by wrapping around (micro-batched plans), not short
    (``None``: either).
    """
    shares, stand_in = gathered(model.shares), gathered(model.stand_in)
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = len(shares[0])
    assert steps == trainer.global_step == epochs * -(-N // (2 * BATCH)), (steps, trainer.global_step)
    for k in range(steps):
        idx = torch.tensor([i for r in range(2) if not stand_in[r][k] for i in shares[r][k]], dtype=torch.long)
        if k < 3 and padded is not None:  # each epoch covers the data once
            assert len(idx) == (8 if padded else min(8, N - 8 * k)), (k, idx)
        opt.zero_grad()
        F.mse_loss(ref(X[idx]), Y[idx]).backward()
        opt.step()
    covered = {i for r in range(2) for k in range(3) if not stand_in[r][k] for i in shares[r][k]}
    assert covered == set(range(N)), covered
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        full = p.full_tensor().detach()  # collective: every rank, in the same order
        err = (full - q.detach()).abs().max().item()
        assert err < 1e-12, f"parameter {name} differs from the single-process full-batch SGD by {err}"
    return shares, stand_in


@scenario("uneven")
def _():
    # Shares [6, 2]; the last global batch of 4 is cut in proportion, [3, 1], and weighted by it.
    model, trainer = fit(HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=plan_of(6, 2)))
    shares, _ = assert_full_batch_sgd(model, trainer)
    assert [len(s) for s in shares[RANK][:3]] == [[6, 6, 3], [2, 2, 1]][RANK], shares[RANK]


@scenario("zero")
def _():
    # Rank 1's share is 0: it runs two real samples of the global batch (FSDP2's forward is collective), weighted 0.
    model, trainer = fit(HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=plan_of(8, 0)))
    shares, stand_in = assert_full_batch_sgd(model, trainer)
    assert all(stand_in[1]) and not any(stand_in[0]), stand_in
    assert [len(s) for s in shares[1]] == [2] * 6, shares[1]


@scenario("micro")
def _():
    # Rank 0's share runs as 3 micro-batches; FSDP2 needs as many on every rank, so rank 1 runs its 2 samples
    # as [1, 1] plus a stand-in of two samples weighted 0.
    plan = hetsplit.Plan(["a", "b"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    strategy = HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=plan)
    calls = []
    model, trainer = None, None
    original = Sharded.training_step

    def counted(self, batch, batch_idx):
        calls.append(len(batch[0]))
        return original(self, batch, batch_idx)

    Sharded.training_step = counted
    try:
        model, trainer = fit(strategy)
    finally:
        Sharded.training_step = original
    assert_full_batch_sgd(model, trainer, padded=True)
    assert calls[:3] == [[2, 2, 2], [1, 1, 2]][RANK], calls  # the third of rank 1's is the stand-in (two samples)


@scenario("profiled")
def _():
    # No plan: the ranks profile the sharded module in turns, one plan for both;
    # rank 1 holds at most 2 samples at once, so with accumulate=True every step runs as FSDP2 needs.
    strategy = HeteroModelParallelStrategy(
        devices="cpu,cpu@1:max2", plan_kwargs={"time_budget": 0.3, "accumulate": True}
    )
    model, trainer = fit(strategy, epochs=1)
    plans = gathered((strategy.plan.sizes, strategy.plan.micro_batches))
    assert plans[0] == plans[1] and sum(plans[0][0]) == 8, plans
    assert max(plans[0][1][1], default=0) <= 2, plans  # never more than rank 1's cap at once
    assert_full_batch_sgd(model, trainer, padded=None, epochs=1)


class WithMomentum(Sharded):
    """Sharded with an optimizer state to checkpoint (momentum buffers, sharded as the parameters)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@scenario("rebalanced")
def _():
    # Re-solved after every step from the ranks' busy times (rank 1 a twentieth as fast: a milder slow-down
    # can vanish into a loaded machine's waiting), at most 1 sample moved at once: the shares change on
    # both ranks at the same steps, every step still full-batch SGD.
    eager = hetsplit.Rebalancer(every=1, threshold=0.0, window=1, max_move=0.125)
    strategy = HeteroModelParallelStrategy(devices="cpu,cpu@0.05", plan=plan_of(4, 4), rebalance=eager)
    model, trainer = fit(strategy)
    shares, _ = assert_full_batch_sgd(model, trainer, padded=None)
    changes = gathered(len(strategy.rebalancer.history))
    assert changes[0] == changes[1] >= 1, (changes, shares)


@scenario("resumed")
def _():
    # Shares [6, 2], a sharded checkpoint (a directory) per epoch; a new Trainer and a fresh model resume the
    # first epoch's for the second: the parameters end as the uninterrupted fit's, with the same shares.
    if not dist.is_initialized():  # the first scenario run: Lightning joins this group
        dist.init_process_group("gloo")
    folder = gathered(tempfile.mkdtemp() if RANK == 0 else None)[0]  # one folder both ranks write to
    try:
        strategy = lambda: HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=plan_of(6, 2))
        saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1)
        whole, _ = fit(strategy(), module=WithMomentum, enable_checkpointing=True, callbacks=[saving])
        first = os.path.join(folder, "epoch=0-step=3.ckpt")
        assert os.path.isdir(first), sorted(os.listdir(folder))  # sharded: a folder of shards
        model, trainer = fit(strategy(), module=WithMomentum, ckpt_path=first)
        assert trainer.global_step == 6 and len(model.shares) == 3, (trainer.global_step, model.shares)
        assert model.shares == whole.shares[3:], (model.shares, whole.shares)
        for (name, p), q in zip(model.model.named_parameters(), whole.model.parameters()):
            err = (p.full_tensor() - q.full_tensor()).abs().max().item()  # collective: every rank, in order
            assert err < 1e-12, f"parameter {name} differs from the uninterrupted fit's by {err}"
    finally:
        dist.barrier()
        if RANK == 0:
            shutil.rmtree(folder, ignore_errors=True)


# configure_model leaving no single fully_shard root holding every trainable parameter: refused at setup,
# the same message on both ranks (the process group still serves the next fit).


class NothingSharded(Sharded):
    def configure_model(self):
        pass


class SeveralRoots(Sharded):
    def configure_model(self):  # each layer, not the model holding them
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])


class OutsideRoot(Sharded):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, 1).double()  # trainable, never sharded


def refused(module, *expected):
    try:
        fit(HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=plan_of(6, 2)), module=module)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"{module.__name__}: the fit was not refused")
    messages = gathered(message)
    assert messages[0] == messages[1], messages
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


HOW = "fully_shard(layer, mesh=self.device_mesh['data_parallel']) per layer, then fully_shard(self.model, mesh=...)"


@scenario("sharded_nothing")
def _():
    refused(NothingSharded, "configure_model sharded nothing (no fully_shard module)", HOW)


@scenario("several_roots")
def _():
    refused(SeveralRoots, "2 separate fully_shard roots ['model.0', 'model.2']", "one root's outputs", HOW)


@scenario("outside_root")
def _():
    refused(OutsideRoot, "parameters ['head.weight', 'head.bias'] are outside the fully_shard root 'model'",
            "move them into it", HOW)  # fmt: skip


dist.barrier() if dist.is_initialized() else None
