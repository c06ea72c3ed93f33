"""Replicas: the module on each device for one step, its parameters taken through autograd, its buffers merged back.

Built afresh each step as ``torch.nn.parallel.replicate`` does, sharing the module's hooks; buffers
are each replica's own copies, so replicas running at once never write into one another's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .. import _torch
from ..devices import DeviceLike, parse_devices
from ..tree import to_device
from .reduce import shard_weights

# torch's norm layers count their training steps in this integer buffer; a full-batch
# step advances it as one forward of the module would, however many replicas ran.
_STEP_COUNTER = "num_batches_tracked"


def module_device(module: nn.Module) -> torch.device:
    """Where a module's parameters (else buffers) live; the CPU for a module with neither."""
    first: torch.Tensor | None = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """``torch.nn.parallel.replicate`` for any devices, the CPU and emulated ones included.

    A loss on a replica back-propagates into ``network``'s parameters; buffers are copied,
    hooks shared.

    Args:
        network: The module to replicate (all on one device).
        devices: One device per replica, e.g. ``["cpu", "cpu@0.25"]``.
        detach: Cut the replicas' parameters from ``network``'s graph.

    Returns:
        The replicas, in the order of ``devices``.

    Example:
        >>> a, b = replicate(net, ["cpu", "cpu@0.25"])
        >>> (a(x0).sum() + b(x1).sum()).backward()  # net's .grad: both replicas' gradients
    """
    targets = [d.torch_device for d in parse_devices(devices)]
    return [r.module for r in _Replicator(network).build(targets, "detach" if detach else "graph")]


class _Replica:
    """One step's replica: the module tree, and the tensors that stand for the module's parameters in it."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        self.module = module
        self.params = params  # aligned with the module's parameters (an alias or copy of each)
        self.buffers = buffers  # the buffer tensors the replica started the step with
        # An in-place write into a parameter (or an alias sharing its storage) moves its version.
        self.versions = [_torch.version(t) for t in params]


class _Replicator:
    """Builds each step's replicas of ``module`` (all on one device) and merges their buffer updates back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.named_buffers: list[tuple[str, torch.Tensor]] = []
        self._compiled = _torch.Compiled()

    def build(self, devices: Sequence[torch.device], link: str = "graph") -> list[_Replica]:
        """One step's replicas, one per device in ``devices``; ``link`` as :func:`_param_for`'s ``mode``."""
        modules = list(self.module.modules())
        if link == "leaf" and torch.is_grad_enabled():
            check_backward_hooks(self.module, modules)
        # The module's tensors as of this step, for the engine (targets, merging): walked once.
        named = list(self.module.named_parameters())
        self.names = [n for n, _ in named]
        params: list[torch.Tensor] = [p for _, p in named]
        self.params = params
        self.named_buffers = list(self.module.named_buffers())
        buffers = [b for _, b in self.named_buffers]
        param_at = {id(p): k for k, p in enumerate(params)}
        buffer_at = {id(b): k for k, b in enumerate(buffers)}
        mode = link if torch.is_grad_enabled() or link == "detach" else "none"
        out = []
        for device in devices:
            own_params = [_param_for(p, device, mode) for p in params]
            own_buffers = self._buffers_for(buffers, device)
            copies = [_torch.shallow_replica(m) for m in modules]
            index = {id(m): i for i, m in enumerate(modules)}
            for m, r in zip(modules, copies):
                children = _torch.own_submodules(r)
                for key, child in _torch.own_submodules(m).items():
                    children[key] = None if child is None else copies[index[id(child)]]
                own = _torch.own_parameters(r)
                tracked = type(r).__setattr__ is not nn.Module.__setattr__
                for key, p in _torch.own_parameters(m).items():
                    t = None if p is None else own_params[param_at[id(p)]]
                    if tracked and t is not None:
                        # Through the class's setattr, as torch's replicate does: a class that
                        # tracks its weights (an RNN's flat weight list) sees the replica's tensors.
                        _torch.set_own_parameters(r, {})
                        setattr(r, key, t)
                        _torch.set_own_parameters(r, own)
                    # Listed as the replica's parameters: a model that asks next(self.parameters())
                    # for its device or dtype still gets an answer. They are views or copies in the
                    # module's graph, not Parameters, as in torch's own replicate.
                    own[key] = t
                slots = _torch.own_buffers(r)
                for key, b in _torch.own_buffers(m).items():
                    slots[key] = None if b is None else own_buffers[buffer_at[id(b)]]
                if _torch.is_compiled(m):
                    self._compiled.attach(m, r)  # after its children: a compiled call runs the replica's
            out.append(_Replica(copies[0], own_params, own_buffers))
        return out

    def check_unwritten(self, replica: _Replica) -> None:
        """Refuse (``RuntimeError``) a forward that wrote into a parameter: no replica reproduces the module's."""
        for name, t, seen in zip(self.names, replica.params, replica.versions):
            if _torch.version(t) != seen:
                raise RuntimeError(
                    f"the model's forward wrote into its parameter {name!r} in place (a data-dependent "
                    "initialisation such as ActNorm's, or a reset in forward): each replica holds a view or copy of "
                    "the parameters and sees only its shard, so the plain module's result cannot be reproduced; run "
                    "that first forward on the module itself (dp.module(x) under torch.no_grad(), on the batch it "
                    "should see), or write the parameter outside forward"
                )

    @staticmethod
    def _buffers_for(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        # Fresh copies every step, never written into: a graph that saved the last step's
        # (two forwards before one backward) keeps the values it saved. Whether a buffer
        # changed cannot be told from its version (BatchNorm updates its statistics without
        # bumping it), so none is reused.
        with torch.no_grad():
            return [b.clone() if b.device == device else b.to(device, copy=True) for b in buffers]

    @torch.no_grad()
    def merge_buffers(self, replicas: Sequence[_Replica], sizes: Sequence[int], runs: Sequence[int]) -> None:
        """Write the replicas' buffer updates of one step into the module (``runs``: each one's forwards).

        Floating buffers: the shard-weighted average (a running mean of batch means equals the
        full-batch one); integers: the sum of increments, ``num_batches_tracked`` as one forward;
        booleans: what a replica changed. Nothing is read back, so a GPU never waits here.
        """
        if not self.named_buffers:
            return  # the common case for many models: nothing to merge
        names = [name for name, _ in self.named_buffers]
        targets = [b for _, b in self.named_buffers]
        current = [list(r.module.buffers()) for r in replicas]
        if any(len(bufs) != len(targets) for bufs in current):
            raise RuntimeError(
                f"a replica's forward added or removed buffers (the module has {len(targets)}, the replicas "
                f"{[len(b) for b in current]}): register every buffer in __init__"
            )
        weights = shard_weights(list(sizes))
        for k, (name, target) in enumerate(zip(names, targets)):
            values = [to_device(bufs[k], target.device) for bufs in current]
            counter = name.rsplit(".", 1)[-1] == _STEP_COUNTER and not target.is_floating_point()
            if counter:  # one step, however many replicas and micro-batches counted it
                per_run = torch.stack([(v - target) // max(n, 1) for v, n in zip(values, runs)])
                target.add_(per_run.amax(0).to(target.dtype))
            elif len(values) == 1:
                target.copy_(values[0])  # one replica: its values are the step's
            elif target.dtype == torch.bool:
                flipped = torch.stack([v != target for v in values]).any(0)
                target.copy_(torch.where(flipped, ~target, target))
            elif target.is_floating_point() or target.is_complex():
                merged = sum((v * w for v, w in zip(values[1:], weights[1:])), values[0] * weights[0])
                # A weighted mean of equal numbers can round: unchanged elements keep their value.
                unchanged = torch.stack([v == target for v in values]).all(0)
                target.copy_(torch.where(unchanged, target, merged))
            else:
                target.add_(torch.stack([v - target for v in values]).sum(0).to(target.dtype))


def _param_for(p: torch.Tensor, device: torch.device, mode: str) -> torch.Tensor:
    """The tensor that stands for parameter ``p`` in a replica on ``device``.

    ``"graph"``: an alias or copy through autograd; ``"leaf"`` (the engine's steps): a leaf of the
    replica's own sharing ``p``'s storage, so a reentrant checkpoint never fills ``p.grad``;
    ``"detach"``: a detached alias or copy; ``"none"`` and frozen parameters: ``p`` or a plain copy.
    """
    if mode == "detach":
        return p.detach().to(device, copy=p.device != device)
    if mode == "none" or not p.requires_grad:
        return p if p.device == device else p.detach().to(device)
    if mode == "leaf":
        return p.detach().to(device).requires_grad_()
    return p.view_as(p) if p.device == device else p.to(device)


def check_wrappable(module: nn.Module) -> None:
    """Refuse (``ValueError``), before any device work, a module whose parameters are not there yet (lazy modules)."""
    lazy = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if is_lazy(t)]
    if lazy:
        raise ValueError(
            f"the module has uninitialized (lazy) parameters {lazy[:3]}{' ...' if len(lazy) > 3 else ''}: "
            "HeteroDataParallel hands every parameter to its replicas before the forward that would create them; "
            "call the model once on one sample first (model(x[:1])), then wrap it and build the optimizer"
        )


def check_backward_hooks(module: nn.Module, modules: Sequence[nn.Module]) -> None:
    """Refuse (``ValueError``) a module backward hook: it would fire per replica, with a shard's gradients."""

    found = _torch.backward_hook_owner(module, list(modules))
    if found is None:
        return
    if found == "global":
        where = "a global module backward hook (register_module_full_backward_hook)"
    else:
        where = f"module {found!r} has a backward hook (register_full_backward_hook or a pre-hook)"
    raise ValueError(
        f"{where}: through HeteroDataParallel it would fire once per replica with that replica's shard of the "
        "gradients, where the plain module fires once with the whole batch's; use a parameter hook "
        "(p.register_hook fires once with the full-batch gradient) or a hook on the gathered output "
        "(out.register_hook), or remove the hook while training through the wrapper"
    )
