"""Data parallel: HeteroDataParallel, a drop-in nn.DataParallel for mixed devices with uneven shards."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, parse_devices
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.rebalance import Rebalancer
from ..planning.sizes import check_weights, resolve_plan
from ..timing import Lap
from ..tree import batch_length, to_device
from .apply import run_parallel
from .outputs import ScalarPolicy, check_policy, combine, policy_weights
from .reduce import accumulate_gradients
from .replicas import BufferMarks, Replicas
from .scatter_gather import scatter_to
from .sizes import default_profile

__all__ = ["HeteroDataParallel"]

_RUNTIME = ("_replicas", "_step", "_busy", "_last", "_unread", "_lock")


@dataclasses.dataclass
class _Step:
    """What one step runs: the plan, the active devices (non-empty shards) and their shards."""

    plan: Plan
    active: list[int]
    shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = dataclasses.field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [self.plan.sizes[i] for i in self.active]


class HeteroDataParallel(nn.Module):
    """Data parallelism over mixed devices with uneven shards: a drop-in for ``nn.DataParallel``.

    ``forward(*inputs, **kwargs)`` scatters the batch into shards sized by the plan
    (any devices, the CPU too), runs the replicas concurrently, and gathers the outputs
    on ``output_device``, where the loss is computed, as with ``nn.DataParallel``.
    ``loss.backward()`` runs each replica's backward concurrently in its own thread, and
    the gradients arrive in the wrapped module's parameters, summed over shards, so they
    equal the full-batch gradient. For a loss per device without gathering, see
    :meth:`train_step`. ``forward`` only chains :meth:`scatter`, :meth:`replicate`,
    :meth:`parallel_apply` and :meth:`gather`, which keep ``nn.DataParallel``'s
    signatures, so a subclass written for it can override them.

    Outputs: tensors are concatenated along ``dim``; 0-dim floating outputs (a loss the
    model computes itself) follow ``scalar_outputs``; other 0-dim tensors are stacked;
    any other object comes back as a list with one entry per replica that ran.

    Replicas: a replica on the module's device shares the module's parameter storage;
    one on another device holds a copy, refreshed before every step; the module itself
    never runs. Each step every replica starts from the module's buffers; afterwards
    the buffers the forward changed are merged back:
    floating-point ones as the shard-size-weighted average of the replicas' values,
    integer ones by the sum of the replicas' increments (``num_batches_tracked`` by one
    step's). BatchNorm therefore normalises each shard with that shard's statistics,
    as ``nn.DataParallel`` and DDP without ``SyncBatchNorm`` do.

    :attr:`step_times` holds each active device's busy seconds in the last step
    (forward and backward, emulated slowdown included; on CUDA from events, so
    measuring never waits). With ``rebalance``, they are fed to the rebalancer at the
    start of the next step, outside autograd's backward.

    Args:
        module: The model; all its parameters and buffers must be on one device.
        devices: Devices to split across, e.g. ``["cuda:0", "cuda:1", "cpu"]``.
        plan: A :class:`Plan` to follow; a batch of another size is an error unless
            ``profile`` is given too, which is then solved for that size.
        profile: A :class:`Profile` to solve for each batch size.
        weights: Relative throughputs per device (``[4, 1]``: 80/20).
        output_device: Where outputs are gathered (default: the module's device).
        dim: The batch dimension.
        rebalance: ``True`` (or a configured :class:`~hetsplit.Rebalancer`) to re-solve
            the split from the measured step times while training.
        scalar_outputs: How 0-dim floating outputs of the replicas combine: ``"mean"``
            (default: weighted by shard size, so a per-shard mean loss becomes the
            full-batch mean and ``out.loss.backward()`` is exact), ``"sum"``,
            ``"stack"`` (a vector, one entry per replica, as ``nn.DataParallel``), or a
            callable ``(args, kwargs) -> weight`` of a replica's input shard, such as
            :func:`hetsplit.count_tokens` for a padded token loss.

    Raises:
        ValueError: If the module spans devices, the plan's devices differ from
            ``devices``, or the weights or ``scalar_outputs`` are invalid; before any
            device work.

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
        homes = {t.device for t in (*module.parameters(), *module.buffers())}
        if len(homes) > 1:
            raise ValueError(
                f"the module's parameters and buffers are on several devices {sorted(map(str, homes))}; "
                "move the whole module to one device (e.g. module.to('cpu')) before wrapping it"
            )
        if weights is not None and (plan is not None or profile is not None):
            raise ValueError("give weights, or a plan and/or profile, not both")
        self.module = module
        self.dim = dim
        self.scalar_outputs = check_policy(scalar_outputs)
        self._output_device = parse_devices([output_device])[0].torch_device if output_device is not None else None
        self._weights = check_weights(weights, len(self.devices)) if weights is not None else None
        self._profile = profile
        self._plan: Plan | None = None
        self._plans: dict[int, Plan] = {}
        if plan is not None:
            self.set_plan(plan)
        self.rebalancer = rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(profile) if rebalance else None
        self.register_state_dict_post_hook(_drop_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        # Everything here is rebuilt on demand and left out of pickles and deep copies.
        self._replicas: Replicas | None = None
        self._step: _Step | None = None
        self._busy: dict[str, list[Lap]] = {}
        self._last: dict[str, list[Lap]] = {}
        self._unread: deque[tuple[Plan, dict[str, list[Lap]]]] = deque()
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_runtime()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> HeteroDataParallel:
        # .to()/.double()/.cuda() and a parent's .to() come through here: the replicas are
        # rebuilt from the moved module at the next step.
        self._replicas = None
        return super()._apply(fn, recurse)

    @property
    def output_device(self) -> torch.device:
        """Where outputs are gathered: as given, else where the module's parameters are now."""
        if self._output_device is not None:
            return self._output_device
        return next(iter(self.module.parameters()), next(iter(self.module.buffers()), torch.empty(0))).device

    @property
    def device_names(self) -> list[str]:
        """The devices' canonical names, in shard order."""
        return [d.name for d in self.devices]

    # -- plans ---------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan in force: the one used by the last step (or set with :meth:`set_plan`)."""
        return self._plan

    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` from the next step on; weights are dropped, a profile still serves other sizes.

        Raises:
            ValueError: If the plan's devices are not this wrapper's devices.
        """
        if list(plan.devices) != self.device_names:
            raise ValueError(f"the plan is for devices {plan.devices}, but this wrapper runs on {self.device_names}")
        self._plan, self._plans, self._weights = plan, {plan.batch_size: plan}, None

    def sizes_for(self, batch: int) -> list[int]:
        """The shard sizes for a batch of ``batch`` samples under the current settings."""
        plan = self._plans.get(batch)
        if plan is None:
            learned = self.rebalancer is not None and bool(self.rebalancer.log_factors)
            profile = self.rebalancer.corrected(self.device_names) if learned else self._profile
            plan = self._plans[batch] = resolve_plan(
                batch, self.devices, plan=self._plan, profile=profile, weights=self._weights, fallback=self._fallback
            )
        self._plan = plan
        return plan.sizes

    def _fallback(self) -> Profile:
        return default_profile(self.devices)

    # -- the steps, with nn.DataParallel's signatures --------------------------------------

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Device]
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """Cut positional and keyword inputs into this step's shards for ``device_ids`` (the active devices)."""
        assert self._step is not None
        shards = scatter_to((tuple(inputs), dict(kwargs or {})), device_ids, self._step.sizes, self.dim)
        return [tuple(a) for a, _ in shards], [dict(k) for _, k in shards]

    def replicate(self, module: nn.Module, device_ids: Sequence[Device]) -> list[nn.Module]:
        """The replicas of ``module`` on ``device_ids`` (some of :attr:`devices`), in step with the module."""
        if self._replicas is None or self._replicas.module is not module:
            self._replicas = Replicas(module, self.devices)
        step = self._step
        if step is not None and len(step.active) == len(device_ids):
            return self._replicas.get(step.active)
        free = list(range(len(self.devices)))  # outside a step: match the devices in order
        return self._replicas.get(
            [free.pop(next(k for k, i in enumerate(free) if self.devices[i] == d)) for d in device_ids]
        )

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]]
    ) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])`` concurrently, each at its device's speed."""
        fns = [lambda r=r, a=a, k=k: r(*a, **k) for r, a, k in zip(replicas, inputs, kwargs)]
        return self._run(fns, "")

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        """Combine the replicas' outputs on ``output_device``; backward runs per replica."""
        step = self._step
        assert step is not None
        labels = [str(i) for i in step.active]
        weights = lambda: policy_weights(self.scalar_outputs, step.sizes, step.shards)
        return combine(outputs, output_device, self.dim, weights, self._backward_runner(step), labels)

    # -- one step ----------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas concurrently, gather on the output device."""
        with self._lock:
            self._begin((inputs, kwargs))
            step = self._step
            assert step is not None
            args, kws = self.scatter(inputs, kwargs, [self.devices[i] for i in step.active])
            step.shards = list(zip(args, kws))
            replicas = self.replicate(self.module, [self.devices[i] for i in step.active])
            marks = BufferMarks(self.module, replicas)
            outputs = self.parallel_apply(replicas, args, kws)
            self._merge_buffers(replicas, step, marks)
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
        """Local-loss mode: each device computes its own shard's loss; no output is gathered.

        Every replica runs forward, ``loss_fn(output, target_shard)`` (``loss_fn(output)``
        without a target) and backward in its own thread, its loss weighted as
        ``reduction`` says (``"mean"``: ``b_i / B``; ``"sum"``: 1; or a callable like
        ``scalar_outputs``), so the module's gradients equal the full-batch ones. Call
        ``optimizer.step()`` afterwards as usual.

        Args:
            inputs: A tensor, a tuple of positional inputs, or a dict of keyword inputs.
            target: The targets, split like ``inputs`` (or ``None``).
            loss_fn: ``loss_fn(output[, target]) -> 0-dim tensor``, e.g. ``F.cross_entropy``.
            reduction: How ``loss_fn`` reduces over samples (see above).
            **kwargs: More keyword inputs of the model, split like the batch.

        Returns:
            The full-batch loss (detached) on the output device.

        Raises:
            ValueError: On a bad ``reduction``, a missing ``loss_fn``, or a loss that is
                not a scalar (naming its shape).
        """
        check_policy(reduction, "reduction")
        if reduction == "stack" or loss_fn is None:
            raise ValueError(
                f"train_step needs loss_fn and a reduction of 'mean', 'sum' or a callable, "
                f"got loss_fn={loss_fn!r}, reduction={reduction!r}"
            )
        args = inputs if isinstance(inputs, tuple) else () if isinstance(inputs, dict) else (inputs,)
        kws = {**inputs, **kwargs} if isinstance(inputs, dict) else dict(kwargs)
        with self._lock:
            self._begin(((args, kws), target))
            step = self._step
            assert step is not None
            devices = [self.devices[i] for i in step.active]
            shards = scatter_to(((args, kws), target), devices, step.sizes, self.dim)
            step.shards = [(tuple(a), dict(k)) for (a, k), _ in shards]
            weights = policy_weights(reduction, step.sizes, step.shards)
            assert weights is not None
            replicas = self.replicate(self.module, devices)
            marks = BufferMarks(self.module, replicas)

            def local(j: int) -> torch.Tensor:
                (a, k), t = shards[j]
                out = replicas[j](*a, **k)
                loss = loss_fn(out, t) if target is not None else loss_fn(out)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise ValueError(
                        f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it "
                        "with .mean() or .sum() and say which with reduction="
                    )
                (loss * weights[j]).backward()
                return loss.detach()

            losses = self._run([lambda j=j: local(j) for j in range(len(devices))], "")
            accumulate_gradients(list(self.module.parameters()), self._sources(step))
            self._merge_buffers(replicas, step, marks)
            self._end_step()
            return sum(to_device(x, self.output_device) * w for x, w in zip(losses, weights))  # type: ignore[return-value]

    def _begin(self, batch_tree: Any) -> None:
        """Start a step: feed the rebalancer the steps it can read, choose this step's plan."""
        self._feed_rebalancer()
        sizes = self.sizes_for(batch_length(batch_tree, self.dim))
        self._step = _Step(self._plan, [i for i, s in enumerate(sizes) if s > 0])  # type: ignore[arg-type]
        self._busy = {}

    def _run(self, fns: Sequence[Callable[[], Any]], what: str, active: Sequence[int] | None = None) -> list[Any]:
        step = self._step
        assert step is not None
        active = step.active if active is None else active
        laps: list[Lap] = []
        out = run_parallel(fns, [self.devices[i] for i in active], [f"{i}{what}" for i in active], laps)
        for i, lap in zip(active, laps):
            self._busy.setdefault(self.devices[i].name, []).append(lap)
        return out

    def _sources(self, step: _Step) -> list[list[torch.Tensor]]:
        return self._replicas.sources(step.active) if self._replicas is not None else []

    def _backward_runner(self, step: _Step) -> Callable[[list[tuple[list[torch.Tensor], list[torch.Tensor]]]], None]:
        def run(work: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            jobs = [(step.active[j], outs, grads) for j, (outs, grads) in enumerate(work) if outs]
            fns = [lambda o=o, g=g: torch.autograd.backward(o, g) for _, o, g in jobs]
            if fns:
                self._run(fns, " (backward)", [i for i, _, _ in jobs])
            accumulate_gradients(list(self.module.parameters()), self._sources(step))
            self._end_step()

        return run

    def _merge_buffers(self, replicas: Sequence[nn.Module], step: _Step, marks: BufferMarks) -> None:
        if self._replicas is not None and replicas:
            self._replicas.merge_buffers(replicas, step.sizes, marks)

    def _end_step(self) -> None:
        self._last = self._busy
        if self.rebalancer is not None and self._step is not None and self._busy:
            self._unread.append((self._step.plan, self._busy))

    def _feed_rebalancer(self) -> None:
        # Steps whose laps can be read without waiting (at once on the CPU; on a GPU once
        # it has run them) go to the rebalancer, so measuring never stalls training.
        new = None
        while self._unread and all(lap.ready() for laps in self._unread[0][1].values() for lap in laps):
            plan, busy = self._unread.popleft()
            times = {name: sum(lap.seconds() for lap in laps) for name, laps in busy.items()}
            new = self.rebalancer.observe(plan, times) or new  # type: ignore[union-attr]
        if new is not None and (self._plan is None or new.sizes != self._plan.sizes):
            self._plan, self._plans = new, {new.batch_size: new}

    @property
    def step_times(self) -> dict[str, float]:
        """Busy seconds of each active device in the last step (waits for a CUDA device to finish it)."""
        return {name: sum(lap.seconds() for lap in laps) for name, laps in self._last.items()}


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
