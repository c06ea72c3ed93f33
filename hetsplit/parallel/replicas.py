"""Replicas: one copy of the module per device, kept in step with it, and its buffers merged back."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device
from ..tree import to_device

__all__ = ["Replicas", "module_device"]

# torch's norm layers count their training steps in this integer buffer; a full-batch
# step advances it by one however many replicas ran.
_STEP_COUNTER = "num_batches_tracked"


def module_device(module: nn.Module) -> torch.device:
    """Where a module's parameters (else buffers) live; the CPU for a module with neither."""
    first = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


class Replicas:
    """Per-device replicas of ``module``, kept in step with it.

    A replica on the module's device shares the module's parameter storage (no copy);
    one on another device holds its own parameters, copied from the module before every
    step. Buffers are copied into every replica before each step, so each starts from
    the module's state, and merged back after it (:meth:`merge_buffers`). The module
    itself never runs: its buffers are written while the replicas' graphs still hold
    their own (BatchNorm's backward checks its running statistics are unchanged), and
    gradients stay on the replicas until :meth:`sources` hands them to the reducer.

    Args:
        module: The wrapped module (all on one device).
        devices: The devices, in shard order.
    """

    def __init__(self, module: nn.Module, devices: Sequence[Device]) -> None:
        self.module, self.devices = module, list(devices)
        self.copies: dict[int, nn.Module] = {}
        self._key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._pairs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Module], list[Any]]] = {}
        self._module_list: list[nn.Module] | None = None
        self._module_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._buffer_names: list[str] = []
        # The module's tensors as of the last get(): the step's gradient targets and buffers.
        self.params: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []

    def get(self, indices: Sequence[int]) -> list[nn.Module]:
        """The replicas of devices ``indices``, synchronised with the module for a step."""
        params = list(self.module.parameters())
        buffers = list(self.module.buffers())
        # The module's structure (which tensors, in which modules, in which mode) rarely
        # changes: the pairing of replica and module tensors is kept until it does.
        key = (tuple(map(id, params)), tuple(map(id, buffers)))
        if key != self._key:
            self._key, self._pairs = key, {}
            self._buffer_names = [name for name, _ in self.module.named_buffers()]
        self.params, self.buffers = params, buffers
        modes = [m.training for m in self._modules()]
        out = []
        for i in indices:
            replica = self.copies.get(i)
            if replica is None or not self._sync(i, replica, params, buffers, modes):
                replica = self.copies[i] = self._build(i)
                self._pairs.pop(i, None)
                self._sync(i, replica, params, buffers, modes)
            out.append(replica)
        return out

    def _modules(self) -> list[nn.Module]:
        if self._module_list is None or self._key != self._module_key:
            self._module_list, self._module_key = list(self.module.modules()), self._key
        return self._module_list

    def _build(self, i: int) -> nn.Module:
        replica = copy.deepcopy(self.module).to(self.devices[i].torch_device)
        for p in replica.parameters():
            p.grad = None
        return replica

    @torch.no_grad()
    def _sync(
        self, i: int, replica: nn.Module, params: list[torch.Tensor], buffers: list[torch.Tensor], modes: list[bool]
    ) -> bool:
        """Bring ``replica`` up to the module's state; ``False`` if it must be rebuilt."""
        pairs = self._pairs.get(i)
        if pairs is None:
            own_params, own_buffers, own_modules = list(replica.parameters()), list(replica.buffers()), []
            own_modules = list(replica.modules())
            if (len(own_params), len(own_buffers), len(own_modules)) != (len(params), len(buffers), len(modes)):
                return False
            pairs = self._pairs[i] = (own_params, own_buffers, own_modules, [None])
        own_params, own_buffers, own_modules, last_modes = pairs
        for rp, mp in zip(own_params, params):
            if rp.dtype != mp.dtype or rp.shape != mp.shape:
                return False
            if rp.device == mp.device:
                if rp.data_ptr() != mp.data_ptr():
                    rp.data = mp.data  # share the module's storage: optimizer steps are seen at once
            else:
                rp.copy_(mp, non_blocking=True)
            if rp.requires_grad != mp.requires_grad:
                rp.requires_grad_(mp.requires_grad)
        for rb, mb in zip(own_buffers, buffers):
            if rb.dtype != mb.dtype or rb.shape != mb.shape:
                return False
            rb.copy_(mb, non_blocking=True)
        if last_modes[0] != modes:
            for rm, mode in zip(own_modules, modes):
                rm.training = mode
            last_modes[0] = modes
        return True

    def sources(self, indices: Sequence[int]) -> list[list[torch.Tensor]]:
        """The parameters of the replicas of devices ``indices``."""
        return [
            self._pairs[i][0] if i in self._pairs else list(self.copies[i].parameters())
            for i in indices
            if i in self.copies
        ]

    @torch.no_grad()
    def merge_buffers(self, replicas: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        """Write the replicas' buffer updates of one step into the module.

        The module never ran, so its buffers still hold the step's starting values.
        Floating-point buffers become the shard-size-weighted average of the replicas'
        values (a running mean of batch means equals the full-batch one); an element no
        replica changed keeps its exact value. Integer buffers advance by the sum of the
        replicas' increments (a counter of samples counts them all), except
        ``num_batches_tracked``, which advances as in one full-batch step (by the
        largest increment). Everything stays on the devices: no value is read back, so a
        GPU is never made to wait here.
        """
        if not self.buffers:
            return  # the common case for many models: nothing to merge, no module walk
        current = [list(r.buffers()) for r in replicas]
        total = float(sum(sizes))
        for k, (name, target) in enumerate(zip(self._buffer_names, self.buffers)):
            values = [to_device(bufs[k], target.device) for bufs in current]
            if len(values) == 1:
                target.copy_(values[0])  # one replica: its values are the step's
            elif target.is_floating_point() or target.is_complex():
                merged = sum((v * (s / total) for v, s in zip(values[1:], sizes[1:])), values[0] * (sizes[0] / total))
                # A weighted mean of equal numbers can round: unchanged elements keep their value.
                unchanged = torch.stack([v == target for v in values]).all(0)
                target.copy_(torch.where(unchanged, target, merged))
            else:
                deltas = torch.stack([v - target for v in values])
                step = deltas.amax(0) if name.rsplit(".", 1)[-1] == _STEP_COUNTER else deltas.sum(0)
                target.add_(step.to(target.dtype))
