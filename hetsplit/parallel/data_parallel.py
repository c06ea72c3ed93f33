"""Data parallel: HeteroDataParallel, a drop-in nn.DataParallel for mixed devices with uneven shards."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..devices import Device, DeviceLike, parse_devices
from ..emulation import is_out_of_memory
from ..planning import checks
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.rebalance import Rebalancer
from ..store import is_quiet, warn_at_caller
from ..timing import BusyLog, Lap
from ..tree import batch_length, flatten, move, to_device
from .apply import as_devices, parallel_apply, run_parallel
from .grads import Grads, StepGrads
from .inputs import InputWrites, Upstream, batch_of, call_on, cut_upstream, scatter_inputs
from .local import local_fns, local_inputs, shard_loss
from .micro import (
    MemoryLog,
    Step,
    StepOutOfMemory,
    backward_fn,
    backward_oom,
    cut,
    forward_fns,
    lower_cap,
    recoverable,
    with_recovery,
)
from .outputs import ScalarPolicy, check_policy, combine, policy_weights
from .paying import PayCheck
from .replicas import _Replicator, check_wrappable, module_device
from .scatter_gather import gather, scatter_to
from .sizes import BatchPlans

_RUNTIME = ("_replicator", "_step", "_log", "_lock", "_mem", "_stray", "_pay")


class HeteroDataParallel(nn.Module):
    """Data parallelism over mixed devices with uneven shards: a drop-in for ``nn.DataParallel``.

    ``loss.backward()`` hands the module the sum of the replicas' gradients: the full-batch
    gradient. ``forward`` chains :meth:`scatter`, :meth:`replicate`, :meth:`parallel_apply`
    and :meth:`gather`, with torch's signatures (docs/one-process.md).

    Args:
        module: The model; all its parameters and buffers on one device.
        devices: Devices to split across, e.g. ``["cuda:0", "cuda:1", "cpu"]``.
        plan: A :class:`Plan` to follow (another batch size needs ``profile``).
        profile: A :class:`Profile` to solve for each batch size.
        weights: Relative throughputs per device (``[4, 1]``: 80/20).
        output_device: Where outputs are gathered (default: the module's device).
        dim: The batch dimension.
        rebalance: ``True`` or a :class:`~hetsplit.Rebalancer`: re-solve while training.
        scalar_outputs: ``"mean"`` (shard-size weights), ``"sum"``, ``"stack"`` (a vector), or
            ``(args, kwargs) -> weight`` (:func:`hetsplit.count_tokens`). ``None``: ``"mean"``,
            refusing a value that is a sum over each shard.
        accumulate: Let a device with a memory cap run its share as micro-batches; after an
            out-of-memory error its cap is lowered and the step run again (docs/memory.md).
        quiet: Say nothing about whether the split pays (``HETSPLIT_QUIET=1`` too).
        sync: Deprecated and ignored; removed in hetsplit 0.2.

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
        scalar_outputs: ScalarPolicy = None,
        accumulate: bool = True,
        quiet: bool = False,
        sync: str | None = None,
    ) -> None:
        super().__init__()
        if sync is not None:
            warnings.warn(
                f"HeteroDataParallel(sync={sync!r}) is deprecated and ignored: there is one way to give replicas "
                "the module's parameters now; leave sync= out. It goes in hetsplit 0.2",
                DeprecationWarning,
                stacklevel=2,
            )
        self.devices: list[Device] = parse_devices(devices)
        check_wrappable(module)
        checks.materialised(module, "HeteroDataParallel")  # else torch's "Cannot copy out of meta tensor" at a step
        _check_one_device(module)
        self.module = module
        self.dim = dim
        self.scalar_outputs = check_policy(scalar_outputs)
        self.quiet = quiet
        self._output_device = parse_devices([output_device])[0].torch_device if output_device is not None else None
        rebalancer = rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(profile) if rebalance else None
        self._plans = BatchPlans(
            self.devices,
            plan=plan,
            profile=profile,
            weights=weights,
            rebalancer=rebalancer,
            accumulate=accumulate,
            model=module,
        )
        # Called through nn.Module: torch leaves these unannotated (mypy's exclusion of torch matches them there).
        nn.Module.register_state_dict_post_hook(self, _drop_module_prefix)
        nn.Module.register_load_state_dict_pre_hook(self, _add_module_prefix)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        # Everything here is rebuilt on demand and left out of pickles and deep copies.
        self._replicator: _Replicator | None = None
        self._step: Step | None = None
        self._log = BusyLog()
        self._lock = threading.RLock()
        self._mem = MemoryLog()
        self._stray: Callable[[], None] | None = None  # the last gathered step's check, run at the next
        self._pay = PayCheck()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self._reset_runtime()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # state_dict() keys have no "module." prefix (a checkpoint loads into the plain model),
            # so a name the wrapped module holds directly (a child, parameter or buffer) is looked
            # up there too: torch.func.functional_call(dp, dp.state_dict()) finds "0.weight" as
            # the plain module's does, and swaps the very tensors the replicas are built from.
            inner = _torch.held(self, "module")
            if inner is not None:
                found = _torch.held(inner, name)
                if found is not None:
                    return found
            raise

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> HeteroDataParallel:
        # .to()/.double() (also a parent's) come here: the buffer copies are taken afresh.
        self._replicator = None
        nn.Module._apply(self, fn, recurse)
        return self

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
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """Cut positional and keyword inputs into shards for ``device_ids`` (on its own: as :meth:`sizes_for`)."""
        devices = as_devices(device_ids)
        if self._step is not None:
            return scatter_inputs(inputs, kwargs, devices, self._step.sizes, self.dim)
        if [d.name for d in devices] != self.device_names:
            raise ValueError(
                f"scatter on its own splits over this wrapper's devices {self.device_names}, got "
                f"{[d.name for d in devices]}"
            )
        sizes = self.sizes_for(batch_length(batch_of(tuple(inputs), dict(kwargs or {})), self.dim))
        return scatter_inputs(inputs, kwargs, devices, sizes, self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """This step's replicas of ``module`` on ``device_ids``, parameters through autograd."""
        devices = as_devices(device_ids)
        if self._replicator is None or self._replicator.module is not module:
            self._replicator = _Replicator(module)
        step = self._step
        # A step's replicas have parameters of their own, whose gradients the engine hands to the module's;
        # called on its own, as torch's replicate, they reach the module's parameters through autograd.
        built = self._replicator.build([d.torch_device for d in devices], "leaf" if step is not None else "graph")
        if step is not None:
            step.built = built
        return [r.module for r in built]

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]]
    ) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])`` concurrently, each at its device's speed."""
        step = self._step
        if step is None:
            return parallel_apply(replicas, list(inputs), list(kwargs), self.devices[: len(replicas)])
        shards = list(zip(inputs, kwargs))
        step.pieces = cut(shards, step.micro, self.dim)
        fns = forward_fns(replicas, step, self._mem)
        before = _generators(step.devices)
        outs = self._run(fns, "", step.active)
        if len(step.built) == len(replicas):
            assert self._replicator is not None  # built this step's replicas
            for built in step.built:  # refused before anything is merged or combined
                self._replicator.check_unwritten(built)
        step.random = before != _generators(step.devices)
        step.leaves = [[flatten(o)[0] for o in per_device] for per_device in outs]
        return outs if step.split else [o[0] for o in outs]  # micro-batched: a list per replica

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        """Combine the replicas' outputs on ``output_device``; backward reaches the module through autograd."""
        step = self._step
        if step is None:
            return gather(outputs, output_device, self.dim)
        sizes, shards, labels = step.flat()
        outputs = [o for outs in outputs for o in outs] if step.split else outputs
        weights = lambda: policy_weights(self.scalar_outputs, sizes, shards)
        # Replicas built elsewhere (an overridden replicate) carry their own graph: their
        # outputs are combined as they are, and backward walks through them as torch's would.
        grads = self._step_grads(step, gathered=True) if len(step.built) == len(step.active) else None
        targets = grads.targets if grads is not None else []
        stray = grads.stray_check() if grads is not None and torch.is_grad_enabled() else None
        self.__dict__["_stray"] = stray  # run after the gather's backward, and at the next step for any other
        backward = self._backward(step, grads, stray) if grads is not None else None
        sums = sizes if self.scalar_outputs is None else None  # the default: a sum is refused, not averaged
        return combine(outputs, output_device, self.dim, weights, backward, labels, targets, sums)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas concurrently, gather on the output device."""
        _check_no_transform()
        with self._lock:
            try:
                return with_recovery(lambda: self._forward(inputs, kwargs), self._mem, self._plans, self.devices)
            finally:
                self.__dict__["_step"] = None  # the steps' seams, called on their own, work on their own

    def _forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        step, home = self._begin(batch_of(inputs, kwargs), (inputs, kwargs))
        if home is not None:  # the module's own device has the whole batch: run the module itself
            run = lambda: call_on(self.module, home, inputs, kwargs)
            out = self._mem.watch(step.active[0], step.sizes[0], run, step.devices[0])  # an OOM re-plans
            return move(out, self._output_device or home)
        args, kws = self.scatter(inputs, kwargs, step.devices)
        # Each shard's piece of the inputs: connected for grad, or aliases whose writes pass back.
        step.upstream, step.writes, step.shards = cut_upstream((inputs, kwargs), args, kws, step.sizes, self.dim)
        args, kws = [a for a, _ in step.shards], [k for _, k in step.shards]
        replicas = self.replicate(self.module, step.devices)
        # A forward that fails leaves the buffers as they were (see _merge_after).
        outputs = self.parallel_apply(replicas, args, kws)
        if step.writes is not None:
            step.writes.pass_back()
        self._merge_buffers(step)
        return self.gather(outputs, self.output_device)

    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        reduction: ScalarPolicy = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Local-loss mode: each replica computes its shard's loss and backward; nothing is gathered.

        The gradients are in the module's ``.grad`` when it returns; the loss is detached.

        Args:
            inputs: A tensor, a tuple of positional inputs, or a dict of keyword inputs.
            target: The targets, split like ``inputs`` (``None``: ``loss_fn(output)``).
            loss_fn: ``loss_fn(output[, target]) -> 0-dim tensor``, e.g. ``F.cross_entropy``.
            reduction: Each loss's weight, as ``scalar_outputs`` (``"stack"`` aside).
            **kwargs: More keyword inputs of the model, split like the batch.

        Returns:
            The full-batch loss (detached) on the output device.

        Raises:
            ValueError: On a bad ``reduction`` or ``loss_fn`` (before any device work), or a
                loss that is not a scalar (naming its shape).
        """
        args, kws = local_inputs(inputs, kwargs, loss_fn, reduction)
        _check_no_transform()
        with self._lock:
            run = lambda: self._train_step((args, kws), target, loss_fn, reduction)
            try:
                return with_recovery(run, self._mem, self._plans, self.devices)
            finally:
                self.__dict__["_step"] = None

    def _train_step(self, inputs: Any, target: Any, loss_fn: Any, reduction: ScalarPolicy) -> torch.Tensor:
        """One local-loss step (see :meth:`train_step`), each device's micro-batches in turn."""
        step, home = self._begin((inputs, target), inputs)
        if home is not None:  # the module's own device has the whole batch: the module's own step
            return self._direct_local_step(home, (inputs, target), loss_fn, reduction)
        batch = (inputs, target)
        step.upstream = Upstream(batch, scatter_to(batch, step.devices, step.sizes, self.dim), self.dim)
        step.writes = InputWrites(batch, step.upstream.shards, step.sizes, self.dim)
        shards = step.writes.shards
        replicas = self.replicate(self.module, step.devices)
        step.pieces = cut(shards, step.micro, self.dim)
        make = local_fns(replicas, step, self._mem, self.dim)
        flat = [(tuple(a), dict(k)) for parts in step.pieces for (a, k), _ in parts]
        weights = policy_weights(reduction, [m for sizes in step.micro for m in sizes], flat)
        assert weights is not None
        grads = self._step_grads(step)
        replicator = self._replicator
        assert replicator is not None  # built this step's replicas (as _step_grads checks)
        # Per replica: backwards begun and finished (each follows its micro-batch's forward).
        begun, finished = [0] * len(step.active), [0] * len(step.active)

        def capture(j: int, outputs: list[torch.Tensor], given: Any) -> Grads:
            begun[j] += 1
            replicator.check_unwritten(step.built[j])
            found = grads.capture(j, outputs, given, retain_graph=False, create_graph=False)
            finished[j] += 1
            return found

        def no_forward_failed() -> bool:  # a replica either finished, or failed in a backward
            return all(f == len(m) or b > f for b, f, m in zip(begun, finished, step.micro))

        captures = [lambda o, g, j=j: capture(j, o, g) for j in range(len(step.active))]
        with self._merge_after(step, no_forward_failed):
            done = self._run(make(weights, loss_fn, target is not None, captures, reduction is None), "", step.active)
        step.writes.pass_back()
        # Every replica has finished: only now does anything reach the module (one engine call).
        grads.deliver(grads.reduce([found or [None] * len(grads.inputs[j]) for j, (_, found) in enumerate(done)]))
        self._finish(step)
        losses = [x for xs, _ in done for x in xs]
        # A piece weighted 0 (no labelled token) adds nothing, not its nan. Added in turn, as sum() would.
        pieces = [to_device(x, self.output_device) * w for x, w in zip(losses, weights) if w]
        if not pieces:  # no piece holds a labelled token: a zero loss, as a tensor like any other step's
            return torch.zeros((), device=self.output_device)
        total = pieces[0]
        for piece in pieces[1:]:
            total = total + piece
        return total

    def _direct_local_step(self, home: torch.device, batch: Any, loss_fn: Any, reduction: ScalarPolicy) -> torch.Tensor:
        """Local-loss mode when the module's own device has the whole batch: the module's own step."""
        (args, kwargs), target = move(batch, home)
        (weight,) = policy_weights(reduction, [1], [(tuple(args), dict(kwargs))]) or [1.0]
        step = self._step
        assert step is not None
        forward = lambda: shard_loss(loss_fn, self.module(*args, **kwargs), target, target is not None)
        loss = self._mem.watch(step.active[0], step.sizes[0], forward, step.devices[0])  # an OOM here re-plans
        try:
            self._mem.watch(step.active[0], step.sizes[0], lambda: (loss * weight).backward())
        except BaseException as e:
            if not is_out_of_memory(e):
                raise
            # Backward writes into the module's .grad as it goes: a re-run here would add those twice.
            line = lower_cap(self._mem, self._plans, self.devices, e)
            raise StepOutOfMemory(
                f"{line}; this happened in the backward of the module's own step, after some of its gradients were "
                "added to the module's .grad: call optimizer.zero_grad() and run the step again"
            ) from e
        self._mem.done(step.active[0], step.sizes[0])
        return to_device(loss.detach(), self.output_device) * weight

    def _step_grads(self, step: Step, gathered: bool = False) -> StepGrads:
        assert self._replicator is not None  # built this step's replicas
        # Gathered outputs: a parameter no replica's outputs reach is no target of the gather.
        reach = gathered and len(step.leaves) == len(step.built)
        outputs = [[t for leaves in per_device for t in leaves] for per_device in step.leaves] if reach else None
        return StepGrads(self._replicator.params, step.built, step.upstream, self._replicator.names, outputs)

    def _backward(
        self, step: Step, grads: StepGrads, stray: Callable[[], None] | None
    ) -> Callable[[list[Any], bool, bool], Grads]:
        """The gather's backward: every device's gradients computed concurrently, summed per target."""

        def run(work: list[tuple[list[torch.Tensor], list[torch.Tensor]]], keep: bool, build: bool) -> Grads:
            if stray is not None:  # once this backward is done
                _torch.queue_after_backward(stray)
            # After a backward that built a graph of the gradients (create_graph), that graph
            # reaches into the replicas' graphs: a later backward through it walks them too,
            # so this node's own walk must leave them for it.
            keep = keep or step.graph_built
            step.graph_built = step.graph_built or build
            fresh = self._rebuilt(step) if build else None
            jobs, pos = [], 0  # per device, its pieces' (outputs, gradients): one, or one per micro-batch
            for j, (i, sizes) in enumerate(zip(step.active, step.micro if step.split else [[s] for s in step.sizes])):
                pieces = work[pos : pos + len(sizes)]
                pos += len(sizes)
                if not any(outs for outs, _ in pieces):
                    continue
                if fresh is None:
                    capture = lambda o, g, j=j: grads.capture(j, o, g, retain_graph=keep, create_graph=build)
                else:  # see _rebuilt: the same forward again, on a replica of its own
                    capture = _again(step, j, fresh[j], grads, pieces)
                jobs.append((j, i, backward_fn(pieces, sizes, i, self._mem, capture)))
            inline = engine_job([self.devices[i] for _, i, _ in jobs], self.output_device)
            try:
                found = self._run([fn for *_, fn in jobs], " (backward)", [i for _, i, _ in jobs], inline)
            except BaseException as e:
                if recoverable(e, self._mem, self.devices):
                    backward_oom(self._mem, self._plans, self.devices, e)
                raise
            per_replica: list[Grads] = [[None] * len(inputs) for inputs in grads.inputs]
            for (j, _, _), got in zip(jobs, found):
                per_replica[j] = got
            if not step.finished:  # a second backward (retain_graph) is not a second step
                step.finished = True
                self._finish(step)
            return grads.reduce(per_replica)

        return run

    def _rebuilt(self, step: Step) -> list[Any]:
        """Fresh replicas for a ``create_graph=True`` backward, which re-runs the forward on them.

        A later backward through the gradients' graph would otherwise walk the replicas'
        graphs a second time, after this node's walk freed them.
        """
        if step.random:
            raise RuntimeError(
                "create_graph=True through HeteroDataParallel runs each replica's forward again, and the model drew "
                "random numbers in its forward (dropout?), which cannot be replayed when replicas share a generator: "
                "compute the gradient penalty with the model in eval() mode or without dropout"
            )
        assert self._replicator is not None
        return self._replicator.build([d.torch_device for d in step.devices], "graph")

    @contextlib.contextmanager
    def _merge_after(self, step: Step, no_forward_failed: Callable[[], bool]) -> Iterator[None]:
        """Merge the replicas' buffer updates after the step, also when it failed in a backward (as the plain module).

        A forward that failed in one replica leaves the buffers as they were, as does a step re-run after an OOM.
        """
        try:
            yield
        except BaseException as e:
            if no_forward_failed() and not recoverable(e, self._mem, self.devices):
                self._merge_buffers(step)
            raise
        self._merge_buffers(step)

    def _merge_buffers(self, step: Step) -> None:
        if self._replicator is not None and len(step.built) == len(step.active):
            self._replicator.merge_buffers(step.built, step.sizes, [len(m) for m in step.micro])

    def _begin(self, batch_tree: Any, call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[Step, torch.device | None]:
        """Start a step: feed the rebalancer, choose the plan; also the module's device if it runs the step itself."""
        stray, self.__dict__["_stray"] = self._stray, None
        if stray is not None:  # a backward of the last step's activations outside the wrapper's output
            stray()
        plans = self._plans
        if self.rebalancer is not None:
            plans.observe(self._log.readable())
        if self._pay.unread:
            unpaid = self._pay.take()
            if unpaid is not None and not is_quiet(self.quiet):
                warn_at_caller(f"hetsplit: {unpaid}")
        if plans.batchnorm:
            plans.trace(*call, self.dim)
        batch = batch_length(batch_tree, self.dim)
        plan = plans.current
        if plan is None or plan.batch_size != batch or plans.minimum > 1:  # else for_batch would hand it out again
            plan = plans.for_batch(batch)
        active = [i for i, s in enumerate(plan.sizes) if s > 0]
        step = self.__dict__["_step"] = Step(plan, active, [self.devices[i] for i in active])  # not nn.Module's setattr
        self._log.start()
        home = direct_device(step, self.module, self.rebalancer is not None)
        if home is not None:  # no busy times: step_times must not repeat the last split step's
            self._log.end(step.plan, keep=False)
        elif self._paying(plan):
            self._pay.start(step)
        return step, home

    def _paying(self, plan: Plan) -> bool:
        """Whether the pay check still reads steps of ``plan``: not once it has spoken, nor for a plan it settled."""
        return not self._pay.said and plan is not self._pay.settled

    def _run(
        self, fns: Sequence[Callable[[], Any]], what: str, active: Sequence[int], inline: int | None = 0
    ) -> list[Any]:
        # The calling thread runs the first job itself (run_parallel's own default): with every job
        # in a worker, the second worker started 1.2-3.1 ms into a LeNet forward on the 2-vCPU VM,
        # and balanced steps took 13-18 % longer (docs/benchmarks.md). A backward names its own.
        laps: list[Lap] = []
        out = run_parallel(fns, [self.devices[i] for i in active], [f"{i}{what}" for i in active], laps, inline)
        for i, lap in zip(active, laps):
            self._log.add(self.devices[i].name, lap)
        return out

    def _finish(self, step: Step) -> None:
        """End a step whose backward has run: its busy times logged, and timed against its fastest device alone."""
        self._log.end(step.plan, keep=self.rebalancer is not None)
        settled = self.rebalancer is None or self.rebalancer.steps >= self.rebalancer.every  # it re-solved once
        if settled and self._paying(step.plan):
            self._pay.end(step, step.plan, self._log.last)

    @property
    def step_times(self) -> dict[str, float]:
        """Busy seconds of each active device in the last step (waits for a CUDA device to finish it)."""
        return self._log.last_times()


def _generators(devices: Sequence[Device]) -> list[bytes]:
    """The states of the random generators work on ``devices`` draws from (to tell whether a forward drew)."""
    kinds = {d.torch_device for d in devices if d.type == "cuda"}
    states = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in sorted(kinds, key=str)]
    return [s.numpy().tobytes() for s in states]


def _again(step: Step, j: int, replica: Any, grads: StepGrads, pieces: list[Any]) -> Callable[..., Grads]:
    """A capture for device ``j`` that runs each micro-batch's forward again on ``replica`` and differentiates that."""
    inputs = grads.stand_ins(replica, j)
    order = iter(range(len(pieces)))

    def capture(outs: list[torch.Tensor], given: list[torch.Tensor]) -> Grads:
        m = next(order)
        args, kwargs = step.pieces[j][m]
        with torch.enable_grad():
            leaves = flatten(replica.module(*args, **kwargs))[0]
        at = {id(t): k for k, t in enumerate(step.leaves[j][m])}
        return grads.capture(
            j, [leaves[at[id(t)]] for t in outs], given, retain_graph=True, create_graph=True, inputs=inputs
        )

    return capture


def _check_no_transform() -> None:
    """Refuse a step under ``torch.func`` transforms, before any device work: they do not reach worker threads."""
    if _torch.functorch_transforms_active():
        raise RuntimeError(
            "HeteroDataParallel cannot run inside a torch.func transform (grad, vjp, vmap, jacrev, ...): its replicas "
            "run in worker threads, which the transform does not reach; apply the transform to the plain module "
            "(dp.module), or take gradients through the wrapper with loss.backward() or torch.autograd.grad"
        )


def _check_one_device(module: nn.Module) -> None:
    homes = {t.device for t in (*module.parameters(), *module.buffers())}
    if len(homes) > 1:
        raise ValueError(
            f"the module's parameters and buffers are on several devices {sorted(map(str, homes))}; "
            "move the whole module to one device (e.g. module.to('cpu')) before wrapping it"
        )


def _drop_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the wrapped module's keys without ``module.``, at any nesting depth."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = _torch.state_dict_metadata(state_dict)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix + key[len(inner) :] if key != inner[:-1] else prefix[:-1]] = metadata.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load hook: accept checkpoints of the plain model (no ``module.``) as well as wrapped ones."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def engine_job(devices: Sequence[Device], output: torch.device) -> int | None:
    """Which backward job runs in the calling thread (the autograd engine's): ``None`` for none.

    On a GPU that thread is the only one the engine runs that GPU's work on, so a replica there
    must run inline or the engine waits on itself; on the CPU the first CPU job runs there.
    """
    kind = "cuda" if output.type == "cuda" else "cpu"
    target = output if kind == "cuda" else None
    return next(
        (k for k, d in enumerate(devices) if d.type == kind and (target is None or d.torch_device == target)), None
    )


def direct_device(step: Step, module: nn.Module, rebalancing: bool) -> torch.device | None:
    """The module's device when one real device, the module's own, has the whole batch, else ``None``.

    Not while rebalancing (only the replicas' threads measure busy times), on a slowed device (its
    throttle runs in the replica's thread), nor with micro-batches.
    """

    if rebalancing or len(step.active) != 1 or step.devices[0].speed != 1.0 or step.split:
        return None
    home = module_device(module)
    return home if step.devices[0].torch_device == home else None
