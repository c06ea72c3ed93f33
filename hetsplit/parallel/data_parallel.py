"""Data parallel: HeteroDataParallel, a drop-in nn.DataParallel for mixed devices with uneven shards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, parse_devices
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.rebalance import Rebalancer
from ..timing import Lap
from ..tree import batch_length, move, to_device
from .apply import run_parallel
from .busy import BusyLog
from .outputs import ScalarPolicy, check_policy, combine, policy_weights
from .reduce import accumulate_gradients
from .replicas import Replicas, module_device
from .sizes import BatchPlans
from .step import (
    Step,
    batch_of,
    call_on,
    check_one_device,
    cut_upstream,
    direct_device,
    direct_local_step,
    engine_job,
    local_inputs,
    local_shards,
    local_step,
    positions,
    scatter_inputs,
)

__all__ = ["HeteroDataParallel"]

_RUNTIME = ("_replicas", "_step", "_log", "_lock")


class HeteroDataParallel(nn.Module):
    """Data parallelism over mixed devices with uneven shards: a drop-in for ``nn.DataParallel``.

    ``forward`` scatters the batch into shards sized by the plan (any devices, the CPU
    too), runs the replicas concurrently and gathers the outputs on ``output_device``;
    ``loss.backward()`` runs each replica's backward in its own thread and sums their
    gradients into the module: the full-batch gradient. ``forward`` only chains
    :meth:`scatter`, :meth:`replicate`, :meth:`parallel_apply` and :meth:`gather`, with
    ``nn.DataParallel``'s signatures, so its subclasses still override them.

    Outputs: tensors are concatenated along ``dim``; 0-dim floating ones follow
    ``scalar_outputs``; other 0-dim tensors are stacked; other objects come back as a
    list, one entry per replica that ran. The module itself never runs: replicas share
    its parameter storage (copies on other devices), start each step from its buffers,
    and the buffers a step changed are merged back (floating ones shard-weighted,
    integer ones by the sum of increments; README: "Buffers"). :attr:`step_times` holds
    each device's busy seconds in the last step; with ``rebalance`` they feed the
    rebalancer at the next step.

    Args:
        module: The model; all its parameters and buffers on one device.
        devices: Devices to split across, e.g. ``["cuda:0", "cuda:1", "cpu"]``.
        plan: A :class:`Plan` to follow (another batch size needs ``profile``).
        profile: A :class:`Profile` to solve for each batch size.
        weights: Relative throughputs per device (``[4, 1]``: 80/20).
        output_device: Where outputs are gathered (default: the module's device).
        dim: The batch dimension.
        rebalance: ``True`` or a :class:`~hetsplit.Rebalancer`: re-solve while training.
        scalar_outputs: ``"mean"`` (shard-size weights: a mean loss stays the full-batch
            mean), ``"sum"``, ``"stack"`` (a vector), or ``(args, kwargs) -> weight`` of a
            shard, e.g. :func:`hetsplit.count_tokens`.

    Raises:
        ValueError: If the module spans devices, the plan's devices differ, or the
            weights or ``scalar_outputs`` are invalid; before any device work.

    Example:
        >>> dp = HeteroDataParallel(net, ["cpu", "cpu@0.25"], weights=[4, 1])
        >>> loss = F.cross_entropy(dp(x), y); loss.backward(); opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        devices: str | Sequence[DeviceLike],
        *,
        plan: Plan | None = None,
        profile: Profile | None = None,
        weights: Sequence[float] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        rebalance: bool | Rebalancer = False,
        scalar_outputs: ScalarPolicy = "mean",
    ) -> None:
        super().__init__()
        self.devices: list[Device] = parse_devices(devices)
        check_one_device(module)
        self.module = module
        self.dim = dim
        self.scalar_outputs = check_policy(scalar_outputs)
        self._output_device = parse_devices([output_device])[0].torch_device if output_device is not None else None
        rebalancer = rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(profile) if rebalance else None
        self._plans = BatchPlans(self.devices, plan=plan, profile=profile, weights=weights, rebalancer=rebalancer)
        self.register_state_dict_post_hook(_drop_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        # Everything here is rebuilt on demand and left out of pickles and deep copies.
        self._replicas: Replicas | None = None
        self._step: Step | None = None
        self._log = BusyLog()
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_runtime()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> HeteroDataParallel:
        # .to()/.double() (also a parent's) come here: replicas are rebuilt at the next step.
        self._replicas = None
        return super()._apply(fn, recurse)

    @property
    def output_device(self) -> torch.device:
        """Where outputs are gathered: as given, else where the module's parameters are now."""
        return self._output_device or module_device(self.module)

    @property
    def device_names(self) -> list[str]:
        """The devices' canonical names, in shard order."""
        return [d.name for d in self.devices]

    @property
    def rebalancer(self) -> Rebalancer | None:
        """The online rebalancer (``None``: off); assign one to start rebalancing."""
        return self._plans.rebalancer

    @rebalancer.setter
    def rebalancer(self, value: Rebalancer | None) -> None:
        self._plans.rebalancer = value

    @property
    def plan(self) -> Plan | None:
        """The plan in force: the one used by the last step (or set with :meth:`set_plan`)."""
        return self._plans.current

    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` from the next step on; weights are dropped, a profile still serves other sizes."""
        self._plans.set(plan)

    def sizes_for(self, batch: int) -> list[int]:
        """The shard sizes for a batch of ``batch`` samples under the current settings."""
        return self._plans.for_batch(batch).sizes

    # -- the steps, with nn.DataParallel's signatures --------------------------------------

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Device]
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """Cut positional and keyword inputs into this step's shards for ``device_ids`` (the active devices)."""
        assert self._step is not None
        return scatter_inputs(inputs, kwargs, device_ids, self._step.sizes, self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[Device]) -> list[nn.Module]:
        """The replicas of ``module`` on ``device_ids`` (some of :attr:`devices`), in step with the module."""
        if self._replicas is None or self._replicas.module is not module:
            self._replicas = Replicas(module, self.devices)
        step = self._step
        active = step.active if step is not None and len(step.active) == len(device_ids) else None
        return self._replicas.get(active if active is not None else positions(self.devices, device_ids))

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]]
    ) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])`` concurrently, each at its device's speed."""
        assert self._step is not None, "parallel_apply runs inside forward, which chooses the step's devices"
        fns = [lambda r=r, a=a, k=k: r(*a, **k) for r, a, k in zip(replicas, inputs, kwargs)]
        return self._run(fns, "", self._step.active)

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        """Combine the replicas' outputs on ``output_device``; backward runs per replica."""
        step = self._step
        assert step is not None, "gather runs inside forward"
        weights = lambda: policy_weights(self.scalar_outputs, step.sizes, step.shards)
        labels = list(map(str, step.active))
        return combine(outputs, output_device, self.dim, weights, self._backward_runner(step), labels, step.upstream)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas concurrently, gather on the output device."""
        with self._lock:
            step = self._begin(batch_of(inputs, kwargs))
            home = direct_device(step, self.module, self.rebalancer is not None)
            if home is not None:  # the module's own device has the whole batch: run the module itself
                return move(call_on(self.module, home, inputs, kwargs), self._output_device or home)
            args, kws = self.scatter(inputs, kwargs, step.devices)
            args, kws = cut_upstream(step, (inputs, kwargs), args, kws, self.dim)
            replicas = self.replicate(self.module, step.devices)
            outputs = self.parallel_apply(replicas, args, kws)
            self._replicas.merge_buffers(replicas, step.sizes)  # type: ignore[union-attr]
            return self.gather(outputs, self.output_device)

    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        reduction: ScalarPolicy = "mean",
        **kwargs: Any,
    ) -> torch.Tensor:
        """Local-loss mode: each replica computes its shard's loss and backward; nothing is gathered.

        Args:
            inputs: A tensor, a tuple of positional inputs, or a dict of keyword inputs.
            target: The targets, split like ``inputs`` (``None``: ``loss_fn(output)``).
            loss_fn: ``loss_fn(output[, target]) -> 0-dim tensor``, e.g. ``F.cross_entropy``.
            reduction: Each loss's weight: ``"mean"`` (``b_i / B``), ``"sum"`` (1) or a
                callable as ``scalar_outputs``; the gradients are the full-batch ones.
            **kwargs: More keyword inputs of the model, split like the batch.

        Returns:
            The full-batch loss (detached) on the output device.

        Raises:
            ValueError: On a bad ``reduction`` or ``loss_fn`` (before any device work), or a
                loss that is not a scalar (naming its shape).
        """
        args, kws = local_inputs(inputs, kwargs, loss_fn, reduction)
        batch, has_target = ((args, kws), target), target is not None
        with self._lock:
            step = self._begin(batch)
            home = direct_device(step, self.module, self.rebalancer is not None)
            if home is not None:  # the module's own device has the whole batch: run the module itself
                return direct_local_step(self.module, home, batch, has_target, loss_fn, reduction, self.output_device)
            upstream, weights = local_shards(step, batch, reduction, self.dim)
            replicas = self.replicate(self.module, step.devices)
            fns = [
                lambda r=r, shard=shard, w=w: local_step(r, shard, has_target, loss_fn, w)
                for r, shard, w in zip(replicas, upstream.shards, weights)
            ]
            losses = self._run(fns, "", step.active)
            self._replicas.merge_buffers(replicas, step.sizes)  # type: ignore[union-attr]
            self._finish(step)
            upstream.backward()  # the inputs' gradients into the caller's graph, once
            return sum(to_device(x, self.output_device) * w for x, w in zip(losses, weights))  # type: ignore[return-value]

    def _begin(self, batch_tree: Any) -> Step:
        """Start a step: feed the rebalancer the steps it can read, choose this step's plan."""
        self._plans.observe(self._log.readable() if self.rebalancer is not None else ())
        plan = self._plans.for_batch(batch_length(batch_tree, self.dim))
        active = [i for i, s in enumerate(plan.sizes) if s > 0]
        step = self.__dict__["_step"] = Step(
            plan, active, [self.devices[i] for i in active]
        )  # not nn.Module's slow setattr
        self._log.start()  # a step that runs the module itself logs no busy time
        return step

    def _run(
        self, fns: Sequence[Callable[[], Any]], what: str, active: Sequence[int], inline: int | None = None
    ) -> list[Any]:
        laps: list[Lap] = []
        out = run_parallel(fns, [self.devices[i] for i in active], [f"{i}{what}" for i in active], laps, inline)
        for i, lap in zip(active, laps):
            self._log.add(self.devices[i].name, lap)
        return out

    def _finish(self, step: Step) -> None:
        """End a step whose backward has run: gradients into the module, busy times logged."""
        if self._replicas is not None:  # the module's parameters as of this step's replicate()
            accumulate_gradients(self._replicas.params, self._replicas.sources(step.active))
        self._log.end(step.plan, keep=self.rebalancer is not None)

    def _backward_runner(self, step: Step) -> Callable[[list[tuple[list[torch.Tensor], list[torch.Tensor]]]], None]:
        def run(work: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            jobs = [(step.active[j], outs, grads) for j, (outs, grads) in enumerate(work) if outs]
            fns = [lambda o=o, g=g: torch.autograd.backward(o, g) for _, o, g in jobs]
            inline = engine_job([self.devices[i] for i, _, _ in jobs], self.output_device)
            self._run(fns, " (backward)", [i for i, _, _ in jobs], inline)  # no job: nothing runs
            self._finish(step)

        return run

    @property
    def step_times(self) -> dict[str, float]:
        """Busy seconds of each active device in the last step (waits for a CUDA device to finish it)."""
        return self._log.last_times()


def _drop_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the wrapped module's keys without ``module.``, at any nesting depth."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix + key[len(inner) :] if key != inner[:-1] else prefix[:-1]] = metadata.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load hook: accept checkpoints of the plain model (no ``module.``) as well as wrapped ones."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
