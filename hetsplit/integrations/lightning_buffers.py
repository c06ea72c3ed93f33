"""Buffers in a micro-batched Lightning step: each micro-batch's recomputation reads what its forward read.

HeteroDDPStrategy runs each micro-batch's ``training_step`` under activation checkpointing
and recomputes it in the step's one backward, after every micro-batch's forward. A
buffer the forward reads and updates (a spectral norm's power-iteration vector, an
exponential moving average, BatchNorm's running statistics) then holds the value the
last forward left, not the one this micro-batch's forward read; and the recomputation
would update it a second time. :class:`Snapshot` keeps, for one micro-batch, the value
of each buffer its forward changes, as the forward found it; its :meth:`Snapshot.restored`
context hands the recomputation a copy of those values and puts back, by module and
buffer name, the tensors registered before (so an update in place and one that rebinds
the buffer, ``self.mean = 0.9 * self.mean + ...``, are both undone).

Which buffers a forward changes is learnt (:class:`BufferKeeper`, one per module): a
buffer whose tensor is replaced, or whose autograd version counter moves, changed; the
first micro-batched forward (and the first after a submodule switches between training
and evaluation mode) also compares values, which finds changes the version counter does
not show (BatchNorm's running statistics, a write through ``.data``). Memory: one copy of
each buffer a micro-batch's forward changes, per micro-batch, kept until the step's
backward has recomputed it; while a forward runs, also a copy of each buffer an earlier
forward changed (dropped at its end if this one left it alone); while a micro-batch is
recomputed, one more copy of the buffers it changed. The forward that learns copies
every buffer once, for that micro-batch only. Buffers no forward changes (a causal mask)
are not copied after that. A buffer first changed in place on a later step has no copy of
its value on that step, whose recomputation then reads the value the forwards left (a
warning names it; it is copied from then on), unless the version counter misses that
change too (a write through ``.data`` on some steps only), which goes unnoticed.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

_KEEPERS: weakref.WeakKeyDictionary[nn.Module, BufferKeeper] = weakref.WeakKeyDictionary()


class BufferKeeper:
    """What a module's training forwards change in its buffers, learnt from the forwards seen so far.

    Attributes:
        changing: Names of the buffers some forward changed; each forward starts by copying them.
        invisible: Names of those whose changes neither the version counter nor the tensor's
            identity shows (BatchNorm's running statistics): their copy is always kept.
        seen: Names whose changes are known (a name not seen is copied and compared by value).

    Args:
        module: The module whose buffers are kept (held weakly).
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self.changing: set[str] = set()
        self.invisible: set[str] = set()
        self.seen: set[str] = set()
        self.modes: tuple[bool, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> BufferKeeper:
        """The keeper of ``module`` (one per module, for as long as the module lives)."""
        keeper = _KEEPERS.get(module)
        if keeper is None:
            keeper = _KEEPERS[module] = cls(module)
        return keeper

    @property
    def module(self) -> nn.Module:
        """The module (an error if it is gone)."""
        module = self._module()
        if module is None:
            raise RuntimeError("the module of this BufferKeeper was garbage-collected; take BufferKeeper.of(module)")
        return module

    def buffers(self) -> dict[str, Tensor]:
        """Every buffer by its name (a buffer registered in several modules under each of its names)."""
        return dict(self.module.named_buffers(remove_duplicate=False))

    def current(self, name: str) -> Tensor | None:
        """The tensor registered under ``name`` now (``None`` if there is none)."""
        owner, _, leaf = name.rpartition(".")
        return getattr(self.module.get_submodule(owner), leaf, None)

    def register(self, name: str, tensor: Tensor) -> None:
        """Register ``tensor`` as the buffer ``name`` (through the module that owns it)."""
        owner, _, leaf = name.rpartition(".")
        setattr(self.module.get_submodule(owner), leaf, tensor)

    def snapshot(self) -> Snapshot:
        """A :class:`Snapshot` for one micro-batch (enter it around the forward)."""
        return Snapshot(self)


class Snapshot:
    """One micro-batch's buffers as its forward found them: entered around it, restored for each recomputation.

    Attributes:
        values: After the forward, each changed buffer's name and its value as the forward
            started (``None`` where no copy was taken in time: a warning said so).

    Args:
        keeper: The module's :class:`BufferKeeper`.
    """

    def __init__(self, keeper: BufferKeeper) -> None:
        self.keeper = keeper
        self.values: dict[str, Tensor | None] = {}
        self._before: dict[str, tuple[Tensor, int]] = {}

    def __enter__(self) -> Snapshot:
        keeper = self.keeper
        modes = tuple(m.training for m in keeper.module.modules())
        if modes != keeper.modes:  # a submodule switched train/eval: what changes may differ
            keeper.seen, keeper.modes = set(), modes
        copies: dict[int, Tensor] = {}  # a buffer under several names is copied once
        for name, buffer in keeper.buffers().items():
            self._before[name] = (buffer, buffer._version)
            if name in keeper.changing or name not in keeper.seen:
                if id(buffer) not in copies:
                    copies[id(buffer)] = buffer.detach().clone()
                self.values[name] = copies[id(buffer)]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        keeper, before, self._before = self.keeper, self._before, {}
        if kind is not None:
            return
        missed = []
        for name, (old, version) in before.items():
            copy = self.values.get(name)
            moved = keeper.current(name) is not old
            changed = moved or old._version != version or name in keeper.invisible
            if not changed and name not in keeper.seen and copy is not None and not torch.equal(copy, old):
                changed = True
                keeper.invisible.add(name)
            if not changed:
                self.values.pop(name, None)
                continue
            keeper.changing.add(name)
            if copy is None:  # not copied as the forward started: still there only if the buffer was rebound
                self.values[name] = old if moved and old._version == version else None
                if self.values[name] is None:
                    missed.append(name)
        keeper.seen.update(before)
        if missed:
            _warn(missed, "its forward")

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Inside: the changed buffers are copies of their values at the forward's start; after, as before entering.

        Each call gives a new context, for one recomputation.
        """
        keeper = self.keeper
        now = {name: (buffer, buffer._version) for name, buffer in keeper.buffers().items()}
        copies: dict[int, Tensor] = {}
        for name, value in self.values.items():
            source = value if value is not None else now[name][0] if name in now else None
            if source is not None:
                if id(source) not in copies:
                    copies[id(source)] = source.detach().clone()
                keeper.register(name, copies[id(source)])
        try:
            yield
        finally:
            for name, (buffer, _) in now.items():
                if keeper.current(name) is not buffer:
                    keeper.register(name, buffer)
            again = [n for n, (b, v) in now.items() if n not in self.values and b._version != v]
            if again:
                keeper.changing.update(again)
                _warn(again, "its recomputation, not its forward,")


def _warn(names: list[str], where: str) -> None:
    warnings.warn(
        f"buffer(s) {names} changed in place in {where} although no earlier micro-batched forward changed "
        "them, so HeteroDDPStrategy kept no copy of their values: this step's recomputation read (or left) the "
        "values after the forwards, not as its forward found them. They are copied from now on; to keep every "
        "step exact, update such buffers on every training forward (not only on some steps)",
        RuntimeWarning,
        stacklevel=3,
    )


class Reenterable(contextlib.AbstractContextManager):  # type: ignore[type-arg]
    """A context manager that can be entered again, even while it is entered: each entry uses ``factory()``'s context.

    Args:
        factory: Makes the context of one entry.
    """

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.factory = factory
        self._entered: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> Any:
        context = self.factory()
        value = context.__enter__()
        self._entered.append(context)
        return value

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> Any:
        return self._entered.pop().__exit__(kind, error, trace)
