"""Elastic: replica groups that leave and join on torchft, the global batch constant and its gradient exact.

Each torchft replica group is one hetsplit rank, or several ranks of one node in their own
torch.distributed world (replicated or FSDP2-sharded inside it; rank 0 alone talks to torchft).
Every step the groups present exchange who they are (one small all-reduce), solve the same plan
for all their ranks from the stored profile, and each rank takes its share of the step's global
batch; gradients are pre-scaled by each rank's samples, summed and divided by the all-reduced
sample count, never by the number of groups.
A step torchft discards (``should_commit`` false) is run again on the same global batch by
the groups then present, so no sample is dropped or seen twice. The guide is docs/elastic.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..devices import canonical_name
from ..planning.plan import Plan, sizes_from_weights
from ..planning.profile import Profile, fingerprint
from ..planning.solver import plan_from_sizes, solve
from .comm_hooks import _scaled
from .sampler import _epoch_order, local_batch
from .sharded import fsdp2_module, kind

# Per rank of every group (a slot), in the membership vector: present, then its own measurement
# (batch, seconds; 0 until taken) for a device the profile lacks. Each slot is written by one rank
# only, so the sum every group receives is bit-identical and every group solves the same plan.
_FIELDS = 3


def _whole(t: Any, copy: bool = False) -> Any:
    """A sharded tensor gathered whole (collective), any other as it is (or a copy)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t.clone() if copy and isinstance(t, torch.Tensor) else t


def _identity(model: torch.nn.Module) -> str:
    """:func:`fingerprint` with FSDP2's class aside: a sharded group and a plain one train the same model."""
    fsdp = fsdp2_module()
    if fsdp is None or not isinstance(model, fsdp):
        return fingerprint(model)
    plain = next(c for c in type(model).__mro__[1:] if not issubclass(c, fsdp))
    h = hashlib.sha256(plain.__qualname__.encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())  # a DTensor's shape is the whole tensor's
    return h.hexdigest()[:16]


def _even(batch_size: int, labels: list[str]) -> Plan:
    """Even shares, before anything is known (the first quorum re-plans)."""
    return plan_from_sizes(None, labels, sizes_from_weights(batch_size, [1.0] * len(labels)))


def _check_reachable(address: str, timeout: float) -> None:
    """One line naming the lighthouse when nothing answers there (torchft would retry for a minute)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        socket.create_connection((url.hostname or "localhost", url.port or 29510), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(
            f"lighthouse {address} unreachable ({e.strerror or e}); start one (torchft_lighthouse --bind "
            f"[::]:{url.port or 29510} --min_replicas 1) or pass its address as lighthouse="
        ) from None


class ElasticGroup:
    """One replica group of an elastic run on torchft: its share of every global batch, weighted exactly.

    A step is ``begin()`` (the quorum, the groups present, this group's share), the
    forward and backward on ``local_batch(global_batch)``, then ``commit()`` (the weighted
    all-reduce, torchft's ``should_commit``, the optimizer step). ``step`` is the index of
    the global batch to train on: it advances only on a committed step.

    Args:
        model: This group's model (the same on every group; a joiner is healed from a peer).
        optimizer: Its optimizer (its state travels with the model when healing).
        batch_size: The global batch, constant whatever the membership.
        devices: Per possible group (the fleet), its device name, or a list of names, one per
            rank of its torch.distributed world (``dist.init_process_group`` first); each
            rank is planned by its name's curve in ``profile``.
        group: This group's index in ``devices``.
        lighthouse: The torchft lighthouse's address (``http://host:port``).
        profile: Step-time curves of the devices (a stored profile: nothing measured on the
            hot path). A device it lacks is given a conservative share (half the slowest
            known device's speed) until its first ``measure`` steps are timed.
        min_groups: Groups needed to commit a step.
        timeout: Seconds for a collective or a heal before the step is discarded.
        quorum_timeout: Seconds to wait for a quorum of ``min_groups``.
        use_async_quorum: Overlap the quorum with the forward; the groups then learn the
            membership from the step's own all-reduce, so new shares apply one step late
            and the step at a change is discarded and re-run (exact, one step lost). For
            groups of one rank only.
        measure: Steps a device missing from the profile is timed on.
        checkpoint: A file :meth:`save` writes (atomically: a checkpoint on disk always
            loads); one that exists is resumed from, at its global-batch position.

    Raises:
        ImportError: Without torchft (``pip install 'hetsplit[elastic]'``).
        ConnectionError: The lighthouse does not answer, in one line naming it.
        ValueError: Invalid arguments, before anything starts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        batch_size: int,
        devices: Sequence[str],
        group: int,
        lighthouse: str,
        profile: Profile | None = None,
        min_groups: int = 1,
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
        use_async_quorum: bool = False,
        measure: int = 3,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        try:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ImportError("hetsplit's elastic groups run on torchft: pip install 'hetsplit[elastic]'") from None
        if not 0 <= group < len(devices):
            raise ValueError(f"group {group} is out of range for {len(devices)} devices; give 0..{len(devices) - 1}")
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        layout = [[d] if isinstance(d, str) else list(d) for d in devices]
        if len(layout[group]) != self.world:
            raise ValueError(
                f"group {group} lists {len(layout[group])} devices {layout[group]} but its torch.distributed world has "
                f"{self.world} ranks; give one device per rank"
            )
        if use_async_quorum and self.world > 1:  # its quorum thread hung connecting to the PG's store (torchft 0.2.0)
            raise ValueError(f"use_async_quorum=True is for groups of one rank; group {group} has {self.world}")
        self._owner = [i for i, names in enumerate(layout) for _ in names]  # slot -> group
        self.slot = sum(map(len, layout[:group])) + self.rank
        if batch_size < len(self._owner):
            raise ValueError(f"batch_size {batch_size} is smaller than the {len(self._owner)} possible ranks")
        self.model, self.optimizer, self.batch_size = model, optimizer, int(batch_size)
        self.names = [canonical_name(d) for names in layout for d in names]
        self.group, self.profile, self.measure = group, profile, measure
        self.known = {n for n in self.names if profile is not None and n in profile.devices}
        self._async = use_async_quorum
        self._measured: list[tuple[int, float]] = []  # (samples, seconds) of this rank's first steps
        self._shared = torch.zeros(len(self.names), _FIELDS, dtype=torch.float64)  # what every rank last said
        self.members: list[int] = [group]
        self._slots = [j for j, g in enumerate(self._owner) if g == group]  # the slots present
        self.plan: Plan = _even(self.batch_size, [self.names[j] for j in self._slots])
        self._fingerprint = _identity(model)
        self._started, self.min_groups, self.checkpoint = 0.0, min_groups, checkpoint
        self._sharded, self._step = kind(model) == "fsdp2", 0
        self._healed: dict[str, Any] | None = None  # a peer's state, until every rank here loads it
        if self._sharded:  # FSDP2 sums the rank-weighted gradients (weighted at the outputs: no per-rank hook)
            fsdp: Any = fsdp2_module()
            for m in model.modules():
                if isinstance(m, fsdp):
                    m.set_gradient_divide_factor(1.0)
            model.register_forward_hook(lambda _m, _a, out: _scaled(out, float(self.samples)))
        self.manager: Any = None
        resumed = None
        if checkpoint is not None and os.path.exists(checkpoint):
            state = torch.load(checkpoint, weights_only=True)
            self._load(state["user"])
            self._apply(state["user"])
            self._healed, resumed, self._step = None, state["torchft"], int(state["torchft"]["step"])
        self._snapshot: dict[str, Any] | None = None
        if self._sharded:  # FSDP2 heals a joiner from a whole copy on rank 0 (torchft asks from its own thread)
            self._keep()
        if self.rank:
            return  # rank 0 speaks for the group to torchft
        _check_reachable(lighthouse, min(timeout, 10.0))
        # Each replica group owns a TCPStore (torchft's process groups meet through it).
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout)),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=min_groups,
            use_async_quorum=use_async_quorum,
            timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=min(timeout, 10.0)),
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"hetsplit_{group}",
            heartbeat_interval=timedelta(milliseconds=100),
        )
        if resumed is not None:
            self.manager.load_state_dict(resumed)

    @property
    def step(self) -> int:
        """The index of the global batch the next step trains on (committed steps so far)."""
        return int(self.manager.current_step()) if self.manager is not None else self._step

    def _full(self, copy: bool = False) -> dict[str, Any]:
        """The whole model and optimizer state (collective in an FSDP2 group: every rank calls it).

        The optimizer's state is keyed by parameter name, so groups sharded otherwise load it;
        ``copy`` copies what is not gathered (a kept copy must not follow the training).
        """
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        optim = self.optimizer.state_dict()
        optim["state"] = {order[i]: {k: _whole(t, copy) for k, t in v.items()} for i, v in optim["state"].items()}
        optim["param_groups"] = [{**g, "params": [order[i] for i in g["params"]]} for g in optim["param_groups"]]
        return {"model": {k: _whole(t, copy) for k, t in self.model.state_dict().items()}, "optim": optim}

    def _state(self) -> dict[str, Any]:
        """What a joiner is healed with: the model, the optimizer, and what it must match."""
        whole = self._snapshot if self._sharded else self._full()
        assert whole is not None
        return {**whole, "hetsplit": {"fingerprint": self._fingerprint, "batch_size": self.batch_size}}

    def _apply(self, state: dict[str, Any]) -> None:
        """Load a whole state on this rank (every rank of the group at once), sharded as this model is."""
        params: dict[str, Any] = dict(self.model.named_parameters())

        def part(name: str, t: Any) -> Any:
            p = params.get(name)
            if isinstance(p, DTensor) and isinstance(t, torch.Tensor) and t.dim() and t.shape == p.shape:
                return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
            return t

        self.model.load_state_dict({k: part(k, t) for k, t in state["model"].items()})
        optim = state["optim"]
        parts = {n: {k: part(n, t) for k, t in v.items()} for n, v in optim["state"].items()}
        self.optimizer.load_state_dict({"state": parts, "param_groups": optim["param_groups"]})
        if self._sharded:
            self._keep()

    def _keep(self) -> None:
        whole = self._full(copy=True)
        self._snapshot = whole if self.rank == 0 else None

    def _load(self, state: dict[str, Any]) -> None:
        """Heal from a peer (applied on every rank by :meth:`_reduce`), refusing another model or global batch."""
        theirs, ours = state["hetsplit"], {"fingerprint": self._fingerprint, "batch_size": self.batch_size}
        if theirs != ours:
            raise ValueError(
                f"group {self.group} refused at the quorum: the running groups train model {theirs['fingerprint']} "
                f"on global batches of {theirs['batch_size']}, this group model {ours['fingerprint']} on "
                f"{ours['batch_size']}; start it with the same model and batch_size"
            )
        self._healed = state

    def _reduce(self, mine: torch.Tensor, decide: Callable[[torch.Tensor], bool]) -> tuple[torch.Tensor, bool]:
        """``mine`` summed over every rank of the groups present, on every rank here, and rank 0's ``decide``.

        The group's ranks sum to rank 0, which sums across the groups through torchft and
        decides; its answer, step and any heal are broadcast to the group's ranks.
        """
        if self.world > 1:
            dist.reduce(mine, 0)
        tail = torch.zeros(3, dtype=torch.float64)
        if self.manager is not None:
            self.manager.allreduce(mine, reduce_op=dist.ReduceOp.SUM).wait()
            tail[0] = float(decide(mine))
            tail[1], tail[2] = self.step, self._healed is not None
        flat = torch.cat([mine, tail])
        if self.world > 1:
            dist.broadcast(flat, 0)
        self._step = int(flat[-2])
        if flat[-1]:  # a joiner's state, from a peer group: loaded by every rank here
            box: list[Any] = [self._healed]
            if self.world > 1:
                dist.broadcast_object_list(box, 0)
            self._healed = None
            self._apply(box[0])
        return flat[:-3], bool(flat[-3])

    def begin(self) -> int:
        """Start a step: the quorum, the groups present and this group's share.

        Returns:
            The index of the global batch to train on (:attr:`step`). With
            ``use_async_quorum`` a joiner learns its step only once healed, after its first
            step, whose contribution torchft zeroes: that first index is stale and harmless.

        Raises:
            TimeoutError: No quorum of ``min_groups`` within ``quorum_timeout``, in one line.
        """
        self.optimizer.zero_grad(set_to_none=False)
        try:
            if self.manager is not None:
                self.manager.start_quorum()
            if not self._async:
                said, ok = self._reduce(self._said().reshape(-1), lambda _: self.manager.errored() is None)
                if ok:
                    self._replan(said.reshape(self._shared.shape))
        except TimeoutError as e:
            saved = f"from {self.checkpoint} (intact; " if self.checkpoint else "from your last checkpoint ("
            raise TimeoutError(
                f"group {self.group}: no quorum at step {self.step} within the quorum timeout ({e}): the other "
                f"groups are gone; restart the groups with checkpoint= {saved}it resumes at its global batch)"
            ) from None
        self._started = time.perf_counter()
        return self.step

    def _said(self) -> torch.Tensor:
        """This group's slot of the membership vector."""
        said = torch.zeros_like(self._shared)
        said[self.slot, 0] = 1.0
        if len(self._measured) >= self.measure and self.names[self.slot] not in self.known:
            said[self.slot, 1:] = torch.tensor(statistics.median_low(self._measured), dtype=torch.float64)
        return said

    def _replan(self, said: torch.Tensor) -> None:
        """Solve the plan for the groups present, the same on every group (the same vector, the same solve)."""
        slots = [j for j in range(len(self.names)) if said[j, 0] > 0.5]
        if self.slot not in slots:  # a failed exchange: keep the plan; the step will be discarded
            return
        if slots == self._slots and torch.equal(said, self._shared):
            return
        self._slots, self._shared = slots, said.clone()
        self.members = sorted({self._owner[j] for j in slots})
        self.plan = self._solve(slots, said)

    def _solve(self, members: list[int], said: torch.Tensor) -> Plan:
        known = [self.names[i] for i in members if self.names[i] in self.known]
        curves: dict[str, list[tuple[int, float]]] = {}
        for i in members:
            b, t = int(said[i, 1]), float(said[i, 2])
            if self.names[i] in self.known:
                continue
            if b > 0:
                curves[f"slot{i}"] = [(b, t)]
            elif known:  # not yet measured: half the slowest known device's speed, at an even share
                even = max(1, self.batch_size // len(members))
                assert self.profile is not None
                slowest = max(self.profile.step_time(n, even) for n in known)
                curves[f"slot{i}"] = [(even, 2 * slowest)]
        labels = [self.names[i] if self.names[i] in self.known else f"slot{i}" for i in members]
        if not known and len(curves) < len(members):  # nothing known about anyone yet: even shares
            return _even(self.batch_size, labels)
        assert self.profile is not None or not known
        entries = [self.profile.entry(n) for n in dict.fromkeys(known)] if self.profile else []
        if curves:
            entries += Profile.from_measurements(curves).entries
        return solve(
            Profile(entries, model=dict(self.profile.model) if self.profile else {}), self.batch_size, devices=labels
        )

    def local_batch(self, batch: Any, dim: int = 0) -> Any:
        """This group's rows of the step's global batch (the same on every group), as :func:`local_batch` cuts it."""
        return local_batch(batch, self.plan, rank=self._slots.index(self.slot), dim=dim, check=False)

    def global_indices(self, n: int, *, shuffle: bool = True, seed: int = 0) -> list[int]:
        """The dataset indices of global batch :attr:`step`: epochs of ``n // batch_size`` whole batches.

        Each epoch is shuffled as :class:`~.sampler.HeteroDistributedSampler` shuffles it
        (``seed + epoch``); the last incomplete batch is dropped, so every step is ``batch_size``.
        """
        per_epoch = n // self.batch_size
        if per_epoch < 1:
            raise ValueError(f"a dataset of {n} samples holds no global batch of {self.batch_size}")
        epoch, k = divmod(self.step, per_epoch)
        order = _epoch_order(n, per_epoch * self.batch_size, shuffle, seed + epoch)
        return order[k * self.batch_size : (k + 1) * self.batch_size]

    @property
    def samples(self) -> int:
        """This rank's real samples in the current step (0 for a zero share's stand-in)."""
        return int(self.plan.sizes[self._slots.index(self.slot)])

    def commit(self) -> bool:
        """All-reduce the sample-weighted gradients, ask torchft, and step the optimizer if the step commits.

        Returns:
            Whether the step committed (else it is run again, on the same global batch).
        """
        took, b = time.perf_counter() - self._started, self.samples
        params: list[Any] = [p for p in self.model.parameters() if p.requires_grad]  # DTensors when sharded
        if self._sharded:  # FSDP2 summed the weighted gradients over the group: rank 0 sends them whole
            grads = [p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape) for p in params]
            grads = grads if self.rank == 0 else [torch.zeros_like(g) for g in grads]
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        n = sum(g.numel() for g in grads)
        tail = [torch.tensor([float(b)], dtype=torch.float64)]
        if self._async:  # the membership travels with the gradients: the plan used is checked after
            tail.append(self._said().reshape(-1))
        scale = 1 if self._sharded else b
        flat = torch.cat([g.reshape(-1).to(torch.float64) * scale for g in grads] + tail)

        def decide(flat: torch.Tensor) -> bool:  # on rank 0, the groups' sum in hand
            if self._async and self.manager.errored() is None:  # a failed all-reduce says nothing of who is here
                used = list(self._slots)
                self._replan(flat[n + 1 :].reshape(self._shared.shape))
                if self._slots != used:  # the shares were solved for other ranks: run the step again
                    self.manager.report_error(RuntimeError("membership changed"))
            if self.manager.errored() is None and float(flat[n]) != self.batch_size:
                self.manager.report_error(RuntimeError(f"{float(flat[n]):g} samples of {self.batch_size}"))
            return bool(self.manager.should_commit())

        flat, ok = self._reduce(flat, decide)
        if not ok:
            return False
        if self._async and self.rank:
            self._replan(flat[n + 1 :].reshape(self._shared.shape))
        offset, total = 0, float(flat[n])
        for p in params:
            grad = (flat[offset : offset + p.numel()] / total).to(p.dtype).reshape(p.shape)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None) if self._sharded else grad
            offset += p.numel()
        self.optimizer.step()
        if self._sharded:
            self._keep()
        if b > 0 and len(self._measured) < self.measure and math.isfinite(took):
            self._measured.append((b, took))
        return True

    def save(self) -> None:
        """Write :attr:`checkpoint` after a committed step: written aside and renamed, so a fault leaves the old one."""
        if self.checkpoint is None:
            raise ValueError("save() needs checkpoint= (a file path) given to ElasticGroup")
        if self.manager is None:
            return  # rank 0 writes the group's
        tmp = f"{self.checkpoint}.tmp{os.getpid()}"
        torch.save({"user": self._state(), "torchft": self.manager.state_dict()}, tmp)
        os.replace(tmp, self.checkpoint)

    def shutdown(self) -> None:
        """Leave the run: stop torchft's servers (the others go on without this group)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def lighthouse(
    min_groups: int = 1, *, bind: str = "127.0.0.1:0", join_ms: int = 10000, heartbeat_ms: int = 1000
) -> Any:
    """Start a torchft lighthouse in this process (tests, benchmarks, one-machine runs).

    ``heartbeat_ms`` is how soon a dead group is dropped. ``join_ms`` is how long a quorum waits
    for a live group that is late to ask (more than half may form one without it): a short wait
    drops a slow group now and then on a loaded machine, to heal again a step later.

    Returns:
        The ``LighthouseServer``; its ``address()`` is what each :class:`ElasticGroup` is given.
    """
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind, min_replicas=min_groups, join_timeout_ms=join_ms, heartbeat_timeout_ms=heartbeat_ms
    )
