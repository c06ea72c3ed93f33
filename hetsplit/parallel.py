"""Parallel: HeteroDataParallel, a drop-in nn.DataParallel for mixed devices with uneven shards."""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from .apply import parallel_apply
from .devices import Device, DeviceLike, Lap, parse_devices
from .profiles import Profile
from .rebalance import Rebalancer
from .reduce import average_buffers, shard_weights
from .scatter_gather import batch_length, flatten, scatter, to_device
from .solver import Plan, check_sizes, plan_from_sizes, sizes_from_weights, solve

__all__ = ["HeteroDataParallel"]


class _GatherBackward(torch.autograd.Function):
    """Concatenate replica outputs; on backward, run every replica's backward concurrently.

    The forward receives *detached* copies of the outputs, so the autograd engine never
    walks into the replicas' graphs from the caller's thread (where it would run all CPU
    backward work serially and unthrottled). Instead, backward slices the incoming
    gradient by shard and hands each slice to its replica's own thread.
    """

    @staticmethod
    def forward(ctx: Any, runner: Callable[..., None], layout: Any, *detached: torch.Tensor) -> Any:
        ctx.runner, ctx.layout = runner, layout
        out = layout.concat(detached)
        ctx.mark_non_differentiable(*[t for t in out if not t.is_floating_point() and not t.is_complex()])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.runner(ctx.layout.split(grads))
        return (None, None) + (None,) * ctx.layout.n_inputs


class _Layout:
    """Where each replica's output tensors sit in the gathered outputs."""

    def __init__(self, columns: list[list[torch.Tensor]], target: torch.device, dim: int) -> None:
        self.columns, self.target, self.dim = columns, target, dim  # columns[k][j]: leaf k of replica j
        self.n_inputs = sum(len(c) for c in columns)

    def concat(self, detached: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out, pos = [], 0
        for column in self.columns:
            parts = [to_device(t, self.target) for t in detached[pos : pos + len(column)]]
            pos += len(column)
            out.append(torch.stack(parts) if column[0].dim() == 0 else torch.cat(parts, dim=self.dim))
        return out

    def split(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per replica: (its output tensors, the matching gradient slices) that need backward."""
        n_rep = len(self.columns[0])
        work: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(n_rep)]
        for column, grad in zip(self.columns, grads):
            if grad is None:
                continue
            if column[0].dim() == 0:
                pieces = list(grad.unbind(0))
            else:
                pieces = list(torch.split(grad, [t.shape[self.dim] for t in column], dim=self.dim))
            for j, (t, g) in enumerate(zip(column, pieces)):
                if t.requires_grad:
                    work[j][0].append(t)
                    work[j][1].append(to_device(g, t.device))
        return work


class HeteroDataParallel(nn.Module):
    """Data parallelism over mixed devices with uneven shards: a drop-in for ``nn.DataParallel``.

    ``forward(*inputs, **kwargs)`` scatters the batch into shards sized by the plan
    (any devices, the CPU too), runs the replicas concurrently, and gathers the outputs
    on ``output_device``, where the loss is computed, as with ``nn.DataParallel``.
    ``loss.backward()`` runs each replica's backward concurrently in its own thread, and
    the gradients arrive in the wrapped module's parameters, summed over shards, so they
    equal the full-batch gradient. For a loss per device without gathering outputs, see
    :meth:`train_step`.

    The steps are overridable methods, as in ``nn.DataParallel``: :meth:`scatter`,
    :meth:`replicate`, :meth:`parallel_apply`, :meth:`gather`.

    Replica synchronisation: each step a replica reads the module's parameters through
    a differentiable copy to its device (a no-op on the module's own device), so it is
    always current after ``optimizer.step()`` and gradients flow back by autograd
    (``sync="copy"``, the default, measured faster in docs/benchmarks.md). With
    ``sync="broadcast"`` replicas keep their own parameters, refreshed in place before
    each step, and their gradients are reduced into the module after backward.

    After each step, :attr:`step_times` holds every active device's busy seconds in it
    (forward and backward, emulated slowdown included): what a device really costs
    while the others run, the input for recalibrating a plan. On CUDA devices they are
    measured with events, so training never waits for them; the rebalancer reads each
    step's times once the device has finished it (usually by the next step), and
    reading :attr:`step_times` yourself waits for the last step.

    BatchNorm: every replica normalises with its own shard's statistics; after each
    training forward the running statistics become the shard-size-weighted average of
    the replicas' (the mean is then exactly the full-batch update), written to the
    module; replicas start every step from the module's buffers.

    Args:
        module: The model; all its parameters must be on one device.
        devices: Devices to split across, e.g. ``["cuda:0", "cuda:1", "cpu"]``.
        plan: A :class:`Plan` to follow; a batch of another size is an error unless
            ``profile`` is given too, which is then solved for that size.
        profile: A :class:`Profile` to solve for each batch size.
        weights: Relative throughputs per device (``[4, 1]``: 80/20).
        output_device: Where outputs are gathered (default: the module's device).
        dim: The batch dimension.
        sync: ``"copy"`` or ``"broadcast"`` (see above).
        rebalance: ``True`` (or a configured :class:`~hetsplit.rebalance.Rebalancer`)
            to re-solve the split from the measured :attr:`step_times` while training;
            off by default. Plan changes apply from the next step; :attr:`plan` is
            always the plan in force.

    Raises:
        ValueError: If the module spans devices, the plan's devices differ from
            ``devices``, or the weights do not match; before any device work.

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
        sync: str = "copy",
        rebalance: bool | Rebalancer = False,
    ) -> None:
        super().__init__()
        self.devices = parse_devices(devices)
        self.device_names = [d.name for d in self.devices]
        homes = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
        if len(homes) > 1:
            raise ValueError(
                f"the module's parameters and buffers are on several devices {sorted(map(str, homes))}; "
                "move the whole module to one device (e.g. module.to('cpu')) before wrapping it"
            )
        if sync not in ("copy", "broadcast"):
            raise ValueError(f"sync must be 'copy' or 'broadcast', got {sync!r}")
        if weights is not None and (plan is not None or profile is not None):
            raise ValueError("give weights, or a plan and/or profile, not both")
        if weights is not None:
            sizes_from_weights(1000, weights)  # validates values
            if len(weights) != len(self.devices):
                raise ValueError(f"got {len(weights)} weights {list(weights)} for {len(self.devices)} devices")
        self.module = module
        self.home = homes.pop() if homes else torch.device("cpu")
        self.output_device = parse_devices([output_device])[0].torch_device if output_device is not None else self.home
        self.dim, self.sync = dim, sync
        self._weights = list(weights) if weights is not None else None
        self._profile = profile
        self._plan: Plan | None = None
        self._plans: dict[int, Plan] = {}
        if plan is not None:
            self.set_plan(plan)
        self.rebalancer: Rebalancer | None = (
            rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(profile) if rebalance else None
        )
        self._replicas: list[nn.Module] | None = None
        self._busy: dict[str, list[Lap]] = {}
        self._last: dict[str, list[Lap]] = {}
        self._unread: deque[tuple[Plan, dict[str, list[Lap]]]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.devices)), thread_name_prefix="hetsplit")
        self._lock = threading.Lock()

    # -- plans ---------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan in force: the one used by the last step (or set with :meth:`set_plan`)."""
        return self._plan

    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` from the next step on, without rebuilding anything.

        Weights given at construction are dropped; a profile given at construction still
        solves batches of other sizes.

        Raises:
            ValueError: If the plan's devices are not this wrapper's devices.
        """
        if list(plan.devices) != self.device_names:
            raise ValueError(f"the plan is for devices {plan.devices}, but this wrapper runs on {self.device_names}")
        self._plan = plan
        self._plans = {plan.batch_size: plan}
        self._weights = None  # a plan replaces weights; a profile still serves other batch sizes

    def sizes_for(self, batch: int) -> list[int]:
        """The shard sizes for a batch of ``batch`` samples under the current settings."""
        if batch < 1:
            raise ValueError(f"the batch is empty (0 samples along dim {self.dim}); nothing to split")
        plan = self._plans.get(batch)
        if plan is None:
            plan = self._make_plan(batch)
            self._plans[batch] = plan
        self._plan = plan
        return plan.sizes

    def _make_plan(self, batch: int) -> Plan:
        if self.rebalancer is not None and self.rebalancer.log_factors:
            if self._profile is not None or self.rebalancer.profile is not None:
                return solve(self.rebalancer.corrected(self.device_names), batch, devices=self.device_names)
            if self._plan is not None:  # learned proportions, applied to a batch of another size
                return plan_from_sizes(None, self.device_names, sizes_from_weights(batch, self._plan.sizes))
        if self._weights is not None:
            return plan_from_sizes(None, self.device_names, sizes_from_weights(batch, self._weights))
        if self._profile is not None:
            return solve(self._profile, batch, devices=self.device_names)
        if self._plan is not None:
            raise ValueError(
                f"the plan splits {self._plan.batch_size} samples, but the batch has {batch}; pass profile= to "
                "solve every batch size, weights= to split any batch in proportion, or drop_last=True to the DataLoader"
            )
        from .split import split_sizes

        return plan_from_sizes(None, self.device_names, split_sizes(batch, self.devices))

    # -- the steps -----------------------------------------------------------------------

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], sizes: Sequence[int]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Cut positional and keyword inputs into one ``(args, kwargs)`` shard per device."""
        return [(tuple(a), dict(k)) for a, k in scatter((inputs, kwargs), self.devices, sizes, dim=self.dim)]

    def replicate(self) -> list[nn.Module]:
        """The per-device replicas (built once; their buffers refreshed from the module)."""
        if self._replicas is None:
            self._replicas = [self._build_replica(d) for d in self.devices]
        with torch.no_grad():
            own = dict(self.module.named_buffers())
            own_params = dict(self.module.named_parameters()) if self.sync == "broadcast" else {}
            for r in self._replicas:
                for name, buf in r.named_buffers():
                    buf.copy_(own[name])
                for name, p in (r.named_parameters() if own_params else ()):
                    p.copy_(own_params[name])
                r.train(self.module.training)
        return self._replicas

    def _build_replica(self, device: Device) -> nn.Module:
        replica = copy.deepcopy(self.module).to(device.torch_device)
        if self.sync == "copy":
            # The replica's own parameters are never read (the module's are passed in each
            # step); drop their storage so a replica costs only its buffers.
            for p in replica.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return replica

    def _params_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: to_device(p, device) for name, p in self.module.named_parameters()}

    def _run_replica(self, i: int, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.sync == "broadcast":
            return replica(*args, **kwargs)
        device = self.devices[i].torch_device
        state = {**self._params_on(device), **dict(replica.named_buffers())}
        return functional_call(replica, state, args, kwargs, strict=False)

    def parallel_apply(self, replicas: Sequence[nn.Module], shards: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
                       active: Sequence[int]) -> list[Any]:
        """Run the active replicas on their shards concurrently; return their outputs."""
        fns = [lambda i=i: self._run_replica(i, replicas[i], *shards[i]) for i in active]
        return self._apply(fns, active, "")

    def _apply(self, fns: Sequence[Callable[[], Any]], active: Sequence[int], what: str) -> list[Any]:
        """parallel_apply on the active devices, adding each one's busy seconds to this step's."""
        laps: list[Lap] = []
        out = parallel_apply(fns, [self.devices[i] for i in active], self._pool, [f"{i}{what}" for i in active], laps)
        for i, lap in zip(active, laps):
            self._busy.setdefault(self.device_names[i], []).append(lap)
        return out

    @property
    def step_times(self) -> dict[str, float]:
        """Busy seconds of each active device in the last step (waits for a CUDA device to finish it)."""
        return {name: sum(lap.seconds() for lap in laps) for name, laps in self._last.items()}

    def _start_step(self) -> None:
        self._busy = {}

    def _end_step(self) -> None:
        self._last = self._busy
        if self.rebalancer is None or self._plan is None or not self._busy:
            return
        self._unread.append((self._plan, self._busy))
        # Feed the rebalancer every step whose laps can be read without waiting (at once
        # on the CPU; on a GPU once it has run them), so measuring never stalls training.
        new = None
        while self._unread and all(lap.ready() for laps in self._unread[0][1].values() for lap in laps):
            plan, busy = self._unread.popleft()
            times = {name: sum(lap.seconds() for lap in laps) for name, laps in busy.items()}
            new = self.rebalancer.observe(plan, times) or new
        if new is not None and new.sizes != self._plan.sizes:
            self._plan = new
            self._plans = {new.batch_size: new}

    def gather(self, outputs: Sequence[Any], output_device: torch.device, active: Sequence[int] = ()) -> Any:
        """Concatenate the replicas' outputs on ``output_device``; backward runs per replica."""
        flat = [flatten(o) for o in outputs]
        spec = flat[0][1]
        for j, (_, s) in enumerate(flat[1:], start=1):
            if s != spec:
                raise ValueError(f"replica {active[j] if active else j} returned a different structure: {s} vs {spec}")
        positions = [k for k, leaf in enumerate(flat[0][0]) if isinstance(leaf, torch.Tensor)]
        columns = [[leaves[k] for leaves, _ in flat] for k in positions]
        leaves = list(flat[0][0])
        if not columns:
            return pytree.tree_unflatten(leaves, spec)
        layout = _Layout(columns, output_device, self.dim)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for c in columns for t in c)
        if needs_grad:
            detached = [t.detach().requires_grad_(t.requires_grad) for c in columns for t in c]
            gathered = _GatherBackward.apply(self._backward_runner(active), layout, *detached)
        else:
            gathered = layout.concat([t for c in columns for t in c])
        for k, value in zip(positions, gathered):
            leaves[k] = value
        return pytree.tree_unflatten(leaves, spec)

    def _backward_runner(self, active: Sequence[int]) -> Callable[[list[tuple[list[torch.Tensor], list[torch.Tensor]]]], None]:
        def run(work: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            jobs = [(j, outs, grads) for j, (outs, grads) in enumerate(work) if outs]
            fns = [lambda outs=outs, grads=grads: torch.autograd.backward(outs, grads) for _, outs, grads in jobs]
            if fns:
                self._apply(fns, [active[j] for j, _, _ in jobs], " (backward)")
            if self.sync == "broadcast":
                self._reduce_replica_grads(active)
            self._end_step()

        return run

    def _reduce_replica_grads(self, active: Sequence[int]) -> None:
        """``sync="broadcast"``: add the replicas' gradients into the module's, then clear them.

        Each replica's gradient is already its shard's share of the full-batch gradient
        (the loss was over the gathered batch, or weighted in :meth:`train_step`).
        """
        assert self._replicas is not None
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                total = None
                for i in active:
                    g = self._replicas[i].get_parameter(name).grad
                    if g is not None:
                        g = g.to(p.device)
                        total = g if total is None else total + g
                if total is not None:
                    p.grad = total if p.grad is None else p.grad + total
            for i in active:
                self._replicas[i].zero_grad(set_to_none=True)

    def _sync_buffers(self, replicas: Sequence[nn.Module], active: Sequence[int], sizes: Sequence[int]) -> None:
        if not self.module.training:
            return
        own = dict(self.module.named_buffers())
        if own:
            average_buffers(own, [dict(replicas[i].named_buffers()) for i in active], [sizes[i] for i in active])

    def _prepare(self, inputs: Any, kwargs: dict[str, Any]) -> tuple[list[int], list[int], Any, list[nn.Module]]:
        batch = batch_length((inputs, kwargs), self.dim)
        sizes = check_sizes(self.sizes_for(batch), batch, len(self.devices))
        active = [i for i, s in enumerate(sizes) if s > 0]
        shards = self.scatter(inputs, kwargs, sizes)
        return sizes, active, shards, self.replicate()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas concurrently, gather on the output device."""
        with self._lock:
            self._start_step()
            sizes, active, shards, replicas = self._prepare(inputs, kwargs)
            outputs = self.parallel_apply(replicas, shards, active)
            self._sync_buffers(replicas, active, sizes)
            out = self.gather(outputs, self.output_device, active)
            if not torch.is_grad_enabled():
                self._end_step()
            return out

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                   reduction: str = "mean") -> torch.Tensor:
        """Local-loss mode: each device computes the loss of its own shard; no output is gathered.

        Every replica runs forward, ``loss_fn(output, target_shard)`` and backward in its
        own thread; its gradient is scaled by its shard's weight (``b_i / B`` for a mean
        loss, 1 for a summed one), so the module's gradients equal the full-batch ones.
        Call ``optimizer.step()`` afterwards as usual.

        Args:
            inputs: The batch (a tensor, or a tuple of positional inputs).
            target: The targets, split like ``inputs``.
            loss_fn: ``loss_fn(output, target) -> scalar``, e.g. ``F.cross_entropy``.
            reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over samples.

        Returns:
            The full-batch loss (detached) on the output device.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        with self._lock:
            sizes, active, shards, replicas = self._prepare((args, target), {})
            weights = shard_weights(sizes, reduction)

            def step(i: int) -> torch.Tensor:
                shard_args, shard_target = shards[i][0]
                out = self._run_replica(i, replicas[i], shard_args, {})
                loss = loss_fn(out, shard_target)
                (loss * weights[i]).backward()
                return loss.detach()

            self._start_step()
            losses = self._apply([lambda i=i: step(i) for i in active], active, "")
            self._end_step()
            if self.sync == "broadcast":
                self._reduce_replica_grads(active)
            self._sync_buffers(replicas, active, sizes)
            total = sum(to_device(loss, self.output_device) * weights[i] for loss, i in zip(losses, active))
            return total if isinstance(total, torch.Tensor) else torch.tensor(float(total))

    # -- the module's own state ----------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's ``state_dict`` (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load into the wrapped module; replicas pick the new state up at the next step."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False)
