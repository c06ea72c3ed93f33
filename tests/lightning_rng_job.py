"""The global random stream a LightningModule sees under each hetsplit strategy, against plain Lightning's.

Run in tests/test_lightning.py's launch after the FSDP2 job (or alone: ``torchrun --standalone
--nproc_per_node=2 tests/lightning_rng_job.py [NAME,...]``). A module draws ``torch.rand(1)``
from torch's global generator in its hooks (Lightning's tensor_parallel example initialises its
weights in ``on_train_start``); every draw must be the one plain Lightning gives at the same
hook. Plain Lightning draws one number before ``on_train_start`` (the training loader's
iterator takes its base seed when the fit loop creates it) and one per evaluation pass and
per later epoch the same way. Prints ``OK``/``FAIL`` per scenario and rank
(``tests/integration_launch.py``).
"""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from integration_launch import scenario  # tests/ is the script's folder
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from hetsplit.lightning import HeteroDDPStrategy, HeteroModelParallelStrategy
from hetsplit.planning import plan_from_sizes

N, BATCH = 20, 4  # a global batch of 8 on 2 ranks: 3 steps per epoch
torch.manual_seed(0)
X, Y = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 1, dtype=torch.float64)
DATA = TensorDataset(X, Y)
RANK = int(os.environ["RANK"])


class Draws(L.LightningModule):
    """Records a draw of the global generator at each hook a user initialises or samples in."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
        self.draws: list[tuple[str, float]] = []

    def _draw(self, hook: str) -> None:
        if self._trainer is not None:  # not while a hetsplit strategy profiles the step
            self.draws.append((hook, torch.rand(1).item()))

    def on_train_start(self) -> None:
        self._draw("on_train_start")

    def on_train_epoch_start(self) -> None:
        self._draw(f"on_train_epoch_start {self.current_epoch}")

    def training_step(self, batch, batch_idx):
        self._draw(f"training_step {self.current_epoch}.{batch_idx}")
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def on_validation_start(self) -> None:
        self._draw("on_validation_start")

    def validation_step(self, batch, batch_idx):
        self._draw(f"validation_step {batch_idx}")
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShardedDraws(Draws):
    """:class:`Draws` sharded with FSDP2 over the data-parallel mesh, as for ModelParallelStrategy."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def draws(strategy, module=Draws, **loader) -> list[tuple[str, float]]:
    """The draws ``module`` records in a 2-epoch fit (shuffled training loader, a validation loader)."""
    L.seed_everything(0)  # (verbose= came in lightning 2.5; the floor prints its one line)
    model = module()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, enable_progress_bar=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    train = DataLoader(DATA, batch_size=BATCH, shuffle=True, **loader)
    trainer.fit(model, train, DataLoader(DATA, batch_size=BATCH, **loader))
    return model.draws


def assert_same(plain, hetero) -> None:
    assert [h for h, _ in plain] == [h for h, _ in hetero], (plain, hetero)
    different = [(h, p, q) for (h, p), (_, q) in zip(plain, hetero) if p != q]
    assert not different, f"draws differ from plain Lightning's (hook, plain, hetsplit): {different}"


PLAN = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])


@scenario("rng_ddp")
def _():
    plain = draws(DDPStrategy())
    assert_same(plain, draws(HeteroDDPStrategy(devices="cpu,cpu@1", plan=PLAN, quiet=True)))
    weights = HeteroDDPStrategy(devices="cpu,cpu@1", plan_kwargs={"weights": [3, 1]}, quiet=True)
    assert_same(plain, draws(weights))
    workers = {"num_workers": 1, "persistent_workers": True}  # the iterator made once, its seed drawn once
    plain_workers = draws(DDPStrategy(), **workers)
    assert_same(plain_workers, draws(HeteroDDPStrategy(devices="cpu,cpu@1", plan=PLAN, quiet=True), **workers))
    quick = {"time_budget": 0.3, "batch_sizes": [1, 2, 4], "calibrate": 0}  # profiling draws, then puts the state back
    assert_same(plain, draws(HeteroDDPStrategy(devices="cpu,cpu@1", plan_kwargs=quick, quiet=True)))


@scenario("rng_model_parallel")
def _():
    plain = draws(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ShardedDraws)
    hetero = HeteroModelParallelStrategy(devices="cpu,cpu@1", plan=PLAN, quiet=True)
    assert_same(plain, draws(hetero, ShardedDraws))
    weights = HeteroModelParallelStrategy(devices="cpu,cpu@1", plan_kwargs={"weights": [3, 1]}, quiet=True)
    assert_same(plain, draws(weights, ShardedDraws))


dist.barrier() if dist.is_initialized() else None
