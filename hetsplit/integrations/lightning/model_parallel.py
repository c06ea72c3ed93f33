"""HeteroModelParallelStrategy: Lightning's FSDP2 strategy with each rank's share of every batch from one plan."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from hetsplit.distributed.sharded import kind

from ..options import HeteroOptions
from .strategy import HeteroStrategy

_WHO = "HeteroModelParallelStrategy"
_HOW = (
    "shard over the data-parallel mesh in configure_model: fully_shard(layer, mesh=self.device_mesh['data_parallel']) "
    "per layer, then fully_shard(self.model, mesh=...) on the module holding them"
)


class HeteroModelParallelStrategy(HeteroStrategy, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with uneven per-rank batches from one hetsplit plan.

    For a model larger than the smallest device (docs/integrations.md, FSDP2):
    ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` becomes
    ``HeteroModelParallelStrategy(devices="cpu,cpu@0.25")``; the LightningModule shards
    itself in ``configure_model`` over ``self.device_mesh["data_parallel"]``, leaving one
    ``fully_shard`` root that holds every trainable parameter. The gradients are weighted at
    that root's outputs, so every per-sample loss term must reach the parameters through them;
    every rank runs the plan's largest number of micro-batches (FSDP2's forwards are collective).

    Args:
        weighting: ``"outputs"`` only (FSDP2 has no comm hook to weight).
        options: The shared arguments, as for :class:`~hetsplit.lightning.HeteroDDPStrategy`.
        data_parallel_size: ``"auto"`` (the world size) or the world size.
        tensor_parallel_size: 1.
        **kwargs: Passed to ``ModelParallelStrategy`` (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).

    Raises:
        TypeError, ValueError: As :meth:`~hetsplit.integrations.options.HeteroOptions.check`, and a
            ``ValueError`` for a ``tensor_parallel_size`` other than 1 or a
            ``data_parallel_size`` that is not a positive number of processes.
    """

    who = _WHO
    weightings = ("outputs",)  # FSDP2 has no comm hook to weight

    def __init__(
        self,
        *,
        weighting: str = "outputs",
        options: HeteroOptions | None = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size != 1 or isinstance(tensor_parallel_size, bool):
            raise ValueError(
                f"{_WHO}(tensor_parallel_size={tensor_parallel_size!r}): tensor parallelism splits every sample's "
                "work over ranks, so their shares could not differ; use tensor_parallel_size=1 (FSDP2 over the "
                "1-D data-parallel mesh), or Lightning's ModelParallelStrategy for tensor parallelism"
            )
        if data_parallel_size != "auto" and (
            isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1
        ):
            raise ValueError(
                f"{_WHO}(data_parallel_size={data_parallel_size!r}): leave it out ('auto': every process is one "
                "data-parallel rank) or give the number of processes"
            )
        super().__init__(
            weighting=weighting, options=options, data_parallel_size=data_parallel_size, tensor_parallel_size=1,
            **kwargs,
        )  # fmt: skip
        self._root: nn.Module | None = None

    @override
    def check_devices(self) -> None:
        """The device list as for every hetsplit strategy, and a 1-D data-parallel mesh of every process."""
        super().check_devices()
        # ModelParallelStrategy keeps its mesh sizes in these attributes of its own (no setter): this
        # subclass fixes them to the 1-D data-parallel mesh before the strategy builds the mesh from them.
        if self._data_parallel_size not in ("auto", self.world_size):
            raise ValueError(
                f"{_WHO}(data_parallel_size={self._data_parallel_size}) with {self.world_size} processes: every "
                f"process is one data-parallel rank with its own share; leave data_parallel_size out "
                f"(or {self.world_size}) and shard on self.device_mesh['data_parallel']"
            )
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up as ``ModelParallelStrategy`` does (``configure_model`` has sharded the model), then find its root."""
        super().setup(trainer)
        self.gradients = self.rebalancer = self.train_sampler = None
        self._root = _fsdp_root(self.module)
        self.weight()

    @override
    def teardown(self) -> None:
        """Remove the weighting's hooks from the root (a later fit with another strategy weights afresh)."""
        if self.gradients is not None:
            for handle in self.gradients.handles:
                handle.remove()
            self.gradients = None
        super().teardown()

    @override
    def weighted_model(self) -> nn.Module | None:
        return self._root

    @override
    def micro_model(self) -> nn.Module:
        if self._root is None:
            raise RuntimeError(f"{_WHO} runs micro-batches through the fully_shard root: set up first")
        return self._root

    @override
    def run_micro_batch(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        # The LightningModule's step itself: its forward of the fully_shard root is what the weighting sees.
        return call(*args, **kwargs)


def _fsdp_root(module: nn.Module) -> nn.Module:
    """The one outermost ``fully_shard`` module of ``module``, holding every trainable parameter (else a ValueError)."""
    roots: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if kind(m) == "fsdp2" and not any(name.startswith(f"{r}.") or r == "" for r, _ in roots):
            roots.append((name, m))
    if not roots:
        raise ValueError(f"{_WHO}: configure_model sharded nothing (no fully_shard module); {_HOW}")
    if len(roots) > 1:
        names = [name or "<the LightningModule>" for name, _ in roots]
        raise ValueError(
            f"{_WHO}: configure_model left {len(roots)} separate fully_shard roots {names}; hetsplit weights "
            f"each rank's gradient at one root's outputs: {_HOW}"
        )
    name, root = roots[0]
    inside = {id(p) for p in root.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"{_WHO}: parameters {outside[:3]} are outside the fully_shard root {name or '<the LightningModule>'!r}: "
            f"nothing would average their gradients over the ranks; move them into it ({_HOW})"
        )
    return root
