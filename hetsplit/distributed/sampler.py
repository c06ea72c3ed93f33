"""Sampler: each rank's share of every global batch, sized by the plan (the uneven ``DistributedSampler``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from ..planning.plan import Plan
from ..planning.sizes import scaled_plan
from ..tree import batch_length, narrow, tree_map
from ._group import group_info
from .same_batch import check_same_batch
from .zero_share import IN_HAND, check_zero_share, stand_in_batch, stand_in_indices


def _epoch_order(n: int, need: int, shuffle: bool, seed: int) -> list[int]:
    """An epoch's ``need`` indices: shuffled with ``seed`` or in order, padded by wrapping around."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if shuffle else list(range(n))
    while 0 < len(order) < need:  # pad by wrapping around, as DistributedSampler does
        order += order[: need - len(order)]
    return order[:need]


def _check_dataset(dataset: Any) -> None:
    """Shares are cut by index: a dataset without ``__len__`` and ``__getitem__`` is one clear error."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{type(dataset).__name__} is an iterable dataset; hetsplit cuts every global batch by index, so it "
            "needs a map-style dataset (with __len__ and __getitem__): wrap the data in one, or cut each global "
            "batch of your own loader with hd.local_batch(batch, plan)"
        )


def _world(num_replicas: int | None, rank: int | None, plan: Plan) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        r, w = group_info(None)
        num_replicas = w if num_replicas is None else num_replicas
        rank = r if rank is None else rank
    if len(plan.sizes) != num_replicas:
        raise ValueError(
            f"the plan has {len(plan.sizes)} shares for {num_replicas} ranks; solve it for this world size"
        )
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is out of range for {num_replicas} ranks")
    return num_replicas, rank


def plan_at(schedule: Sequence[tuple[int, Plan]], step: int) -> Plan:
    """The plan of a ``(first step, plan)`` schedule (oldest first) in force at ``step``."""
    current = schedule[0][1]
    for start, p in schedule:
        if start > step:
            break
        current = p
    return current


class HeteroDistributedSampler(Sampler[list[int]]):
    """This rank's share of every global batch, one step at a time (the uneven ``DistributedSampler``).

    A batch sampler: each step's indices are cut by the plan in force *for that step*
    (:meth:`set_plan`), so shares stay disjoint while sizes change, even with a prefetching
    ``DataLoader``. Use it through :func:`data_loader` (docs/torchrun.md).

    Args:
        dataset: The dataset (its length; :meth:`collate` also reads one item).
        plan: The starting plan, the same on every rank.
        num_replicas: World size (default: the process group's).
        rank: This rank (default: the process group's).
        shuffle: Shuffle each epoch.
        seed: Seed of the shuffle, the same on every rank.
        drop_last: Drop the last incomplete global batch instead of completing it.
        pad: Complete a last incomplete global batch by wrapping around (as ``DistributedSampler``),
            or (``False``: every sample once) cut what is left in the plan's proportions.
        zero_share: What a rank given 0 samples gets each step: ``"sample"``, two real samples
            of the global batch weighted 0 (:meth:`real_rows` counts 0), or ``"empty"``.

    Raises:
        ValueError: If the plan's device count differs from ``num_replicas`` or ``rank`` is out of range.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        plan: Plan,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        zero_share: str = "sample",
    ) -> None:
        _check_dataset(dataset)
        self.num_replicas, self.rank = _world(num_replicas, rank, plan)
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.pad, self.zero_share = pad, check_zero_share(zero_share)
        self.epoch = 0
        self.yielded = 0  # steps handed out so far, across epochs
        self.epoch_start = 0  # the global step of the current epoch's first batch
        self.skip = 0  # batches of the next epoch already trained (a resumed run's)
        self.schedule: list[tuple[int, Plan]] = [(0, plan)]
        n, b = len(dataset), plan.batch_size  # type: ignore[arg-type]
        self.steps = n // b if drop_last else math.ceil(n / b)

    @property
    def batch_size(self) -> int:
        """The global batch: samples per step across all ranks."""
        return self.schedule[0][1].batch_size

    def plan_at(self, step: int) -> Plan:
        """The plan in force at global step ``step``."""
        return plan_at(self.schedule, step)

    def set_plan(self, plan: Plan, from_step: int) -> None:
        """Use ``plan`` from global step ``from_step`` on (call it with the same values on every rank).

        Raises:
            ValueError: If the plan changes the global batch or the number of ranks, or
                ``from_step`` was handed out already.
        """
        if plan.batch_size != self.batch_size or len(plan.sizes) != self.num_replicas:
            raise ValueError(
                f"the new plan splits {plan.batch_size} samples over {len(plan.sizes)} ranks; "
                f"this sampler's global batch is {self.batch_size} over {self.num_replicas} ranks"
            )
        if from_step < self.yielded:
            raise ValueError(
                f"step {from_step} has already been handed out (next is {self.yielded}); "
                "schedule plans from a later step"
            )
        self.schedule = [(s, p) for s, p in self.schedule if s < from_step] + [(from_step, plan)]

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently for ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = epoch

    def resume(self, step: int) -> None:
        """Go on from global batch ``step`` (a checkpoint's), whatever world trained the batches before.

        The next iteration serves epoch ``step // len(self)`` from its ``step % len(self)``-th batch.
        """
        self.epoch, self.skip = divmod(step, self.steps)
        self.yielded = step

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.dataset)  # type: ignore[arg-type]
        order = _epoch_order(n, self._served(n), self.shuffle, self.seed + self.epoch)
        first, self.skip = self.skip, 0
        self.epoch_start = self.yielded - first
        for step in range(first, self.steps):
            start, count, _ = self._cut(step, self.plan_at(self.yielded))
            self.yielded += 1
            if count == 0 and self.zero_share == "sample":
                # Real samples of this global batch, which the weighting counts as 0 (the
                # plan gives this rank 0): models that cannot run 0 rows still run.
                yield stand_in_indices(order, step * self.batch_size, self.batch_size)
            else:
                yield order[start : start + count]

    def _served(self, n: int) -> int:
        """The indices an epoch serves: whole global batches, or every sample once (``pad=False``)."""
        return n if not self.pad and not self.drop_last else self.steps * self.batch_size

    def _cut(self, step: int, plan: Plan) -> tuple[int, int, int]:
        """This rank's ``(start, count, real)`` at epoch step ``step`` under ``plan`` (``real``: no padding)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        cut = self._sizes(step, plan)
        start = step * self.batch_size + sum(cut[: self.rank])
        count = cut[self.rank]
        return start, count, max(0, min(count, n - start))

    def _sizes(self, step: int, plan: Plan) -> list[int]:
        """Every rank's rows at epoch step ``step``: the plan's sizes, or a short last global batch's in proportion."""
        here = min(self.batch_size, self._served(len(self.dataset)) - step * self.batch_size)  # type: ignore[arg-type]
        return list(scaled_plan(plan, here).sizes)

    def step_sizes(self, step: int) -> list[int]:
        """Every rank's rows in batch ``step`` (from the epoch's first): what the gradients must be weighted by."""
        return self._sizes(step, self.plan_at(self.epoch_start + step))

    def short_sizes(self, step: int) -> list[int] | None:
        """Every rank's rows of batch ``step`` (from the epoch's first) if it is short of ``B`` (``pad=False``)."""
        sizes = self.step_sizes(step)
        return sizes if sum(sizes) < self.batch_size else None

    def is_filler(self, step: int) -> bool:
        """Whether batch ``step`` (from the epoch's first) is the stand-in a share of 0 is served."""
        return self.zero_share == "sample" and self._cut(step, self.plan_at(self.epoch_start + step))[1] == 0

    def real_rows(self, step: int) -> int:
        """This rank's rows of batch ``step`` counted once (no stand-in, no padding): weight metrics by it."""
        return self._cut(step, self.plan_at(self.epoch_start + step))[2]

    def padded(self, step: int) -> bool:
        """Whether global batch ``step`` (from the epoch's first) is completed by wrapping around on some rank."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return (step + 1) * self.batch_size > n and self._served(n) > n

    def __len__(self) -> int:
        return self.steps

    def collate(self, batch: list[Any]) -> Any:
        """``default_collate``, with an empty share collated to empty tensors of the right shape."""
        return _Collate(self, None)(batch)


class _SharesLoader(DataLoader[Any]):
    """:func:`data_loader`'s ``DataLoader``: says of each batch it yields whether it is a stand-in (:data:`IN_HAND`)."""

    def __init__(self, dataset: Dataset[Any], shares: HeteroDistributedSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=shares, **kwargs)
        self.shares = shares

    # A generator around torch's iterator, not the iterator object torch's signature names:
    # a training loop only iterates it (and the hand-off must happen as each batch is handed out).
    # torch's iterator is made here, not at the first batch: making it draws its base seed from
    # the global generator, and a framework that calls iter() before its hooks (Lightning's fit
    # loop, before on_train_start) must leave the same random stream to them as a plain loader.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        first = self.shares.skip  # read before torch's iterator runs the sampler (a worker's prefetch)
        return self._handed(super().__iter__(), first)

    def _handed(self, batches: Iterator[Any], first: int) -> Iterator[Any]:
        try:
            for step, batch in enumerate(batches, first):
                IN_HAND.hand(self.shares.is_filler(step), self.shares.short_sizes(step))
                yield batch
        finally:
            IN_HAND.hand(False)


class _Collate:
    """``collate_fn`` for a :class:`HeteroDistributedSampler`: the user's, except for an empty share."""

    def __init__(self, sampler: HeteroDistributedSampler, user: Callable[[list[Any]], Any] | None) -> None:
        self.sampler, self.user = sampler, user

    def __call__(self, batch: list[Any]) -> Any:
        collate = self.user if self.user is not None else default_collate
        if batch:
            return collate(batch)
        # An empty share has the keys and shapes the user's collate gives (labels a collator
        # adds, say): a framework that looks for them then does the same on every rank.
        one = collate([self.sampler.dataset[0]])
        return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)


def local_batch(
    batch: Any, plan: Plan, *, rank: int | None = None, dim: int = 0, group: Any = None, check: bool = True
) -> Any:
    """This rank's rows of a global batch, cut as :func:`data_loader` cuts it: for scripts that make their own batches.

    A shorter global batch (an epoch's last) is cut in the plan's proportions. Some global batches
    are compared across ranks (:mod:`.same_batch`), so every rank calls this for every one.

    Args:
        batch: The global batch, the same on every rank (a tensor or a nest).
        plan: The plan every rank holds.
        rank: This rank (default: the process group's).
        dim: The batch dimension.
        group: The process group (for the rank).
        check: Compare the batch across ranks; ``False`` for a call that not every rank
            makes (an evaluation on rank 0).

    Returns:
        This rank's rows (views of ``batch``).

    Raises:
        ValueError: If the batch holds more samples than the plan's global batch, or the
            plan has another number of shares than the world.
        DistributedError: On every rank, when a checked batch differs across ranks (their
            random generators drifted apart: draw with :func:`shared_batch`).

    Example:
        >>> x, y = next(batches)  # the same global batch of plan.batch_size on every rank
        >>> xb, yb = hd.local_batch((x, y), plan)
    """
    world = len(plan.sizes) if rank is not None else None
    _, rank = _world(world, rank, plan)
    n = batch_length(batch, dim)
    if n > plan.batch_size:
        raise ValueError(
            f"the global batch has {n} samples but the plan splits {plan.batch_size}; pass global batches of "
            f"{plan.batch_size} (or fewer: an epoch's last), or solve the plan for {n}"
        )
    if check:
        check_same_batch(batch, group)
    sizes = list(scaled_plan(plan, n).sizes) if n else [0] * len(plan.sizes)
    start, count = sum(sizes[:rank]), sizes[rank]
    stand_in = count == 0 and n > 0
    IN_HAND.hand(stand_in, sizes if 0 < n < plan.batch_size else None)
    if stand_in:  # as the sampler serves a zero share: the global batch's first rows, weighted 0
        return stand_in_batch(batch, dim, rows=n)
    return narrow(batch, start, count, dim=dim, rows=n)


def data_loader(
    dataset: Dataset[Any],
    plan: Plan,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    pad: bool = True,
    zero_share: str = "sample",
    num_replicas: int | None = None,
    rank: int | None = None,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """This rank's ``DataLoader`` over its shares of every global batch, a share of 0 included.

    Call ``loader.batch_sampler.set_epoch(epoch)`` before each epoch.

    Args:
        dataset: A map-style dataset.
        plan: The plan every rank holds.
        shuffle, seed, drop_last, pad, zero_share, num_replicas, rank: As for
            :class:`HeteroDistributedSampler`.
        **loader_kwargs: Passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ...).

    Raises:
        ValueError: If ``loader_kwargs`` sets the batch size or a sampler.
    """
    taken = sorted({"batch_size", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs))
    if taken:
        raise ValueError(f"data_loader sets {taken} from the plan; leave them out")
    sampler = HeteroDistributedSampler(
        dataset, plan, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
        pad=pad, zero_share=zero_share,
    )  # fmt: skip
    collate = _Collate(sampler, loader_kwargs.pop("collate_fn", None))
    return _SharesLoader(dataset, sampler, collate_fn=collate, **loader_kwargs)


# The shared stream's state, per seed: torch's CPU generator as it stands between training draws.
_STREAMS: dict[int, torch.Tensor] = {}


def shared_batch(
    draw: Callable[..., Any], *args: Any, plan: Plan | None, seed: int = 0, dim: int = 0, group: Any = None
) -> Any:
    """``draw(*args)``, the global batch, drawn from a random stream every rank shares; this rank's rows of it.

    Only these calls advance the stream (torch's CPU generator, swapped in), whatever draws on some
    ranks only; other generators (NumPy's, CUDA's) are not covered, but the check names the batch.

    Args:
        draw: Makes one global batch of ``plan.batch_size`` rows (nanoGPT's ``get_batch``).
        *args: Passed to ``draw`` (``"train"``).
        plan: The plan every rank holds, or ``None`` (one process: the whole batch, unchecked).
        seed: The stream's seed, the same on every rank.
        dim: The batch dimension.
        group: The process group.

    Returns:
        This rank's rows of the global batch (the whole batch without a plan).

    Raises:
        DistributedError: On every rank, if the ranks drew different batches (a checked batch).
        ValueError: As :func:`local_batch`.

    Example:
        >>> X, Y = hd.shared_batch(get_batch, "train", plan=plan)
    """
    mine = torch.get_rng_state()
    stream = _STREAMS.get(seed)
    torch.set_rng_state(stream if stream is not None else torch.Generator().manual_seed(seed).get_state())
    try:
        batch = draw(*args)
    finally:
        _STREAMS[seed] = torch.get_rng_state()
        torch.set_rng_state(mine)
    return batch if plan is None else local_batch(batch, plan, dim=dim, group=group)
