"""Solver: the integer split of a batch that makes all devices finish together."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterator, Sequence

import numpy as np

from ..devices import DeviceLike, canonical_name
from . import checks
from .curve import CurveTable
from .micro import MicroTable, micro_sizes
from .plan import Plan, check_sizes, even_sizes
from .profile import Profile
from .records import DeviceProfile

# Past this many candidate (device, sample) items left after bisection, stop enumerating
# them one by one: bisection only stops that wide when floating point can't separate
# the candidates' times, so they are all equal and any choice among them is optimal.
_ENUMERATE_LIMIT = 1 << 20


def solve(
    profile: Profile, batch_size: int, *, devices: Sequence[DeviceLike] | None = None, accumulate: bool = False
) -> Plan:
    """Find the integer split that minimises the predicted step time ``max_i t_i(b_i)``.

    Exactly optimal for the profile's curves under their memory caps
    (docs/how-it-works.md, "Solver"); a device that would only slow the step gets 0.

    Args:
        profile: Step-time curves of the devices.
        batch_size: Samples to split (>= 1).
        devices: Devices to use, in shard order (default: all in the profile). A name
            may repeat to plan for several identical devices.
        accumulate: Let a capped device run its share as ``k >= ceil(b / cap)`` near-equal
            micro-batches (listed in ``plan.micro_batches``); still exactly optimal.

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: If the batch is empty, or larger than the devices' memory caps allow
            (with ``accumulate=True``: if no device holds even one sample).

    Example:
        >>> p = Profile.from_measurements({"fast": [(100, 0.1)], "slow": [(100, 0.4)]})
        >>> solve(p, 100).sizes
        [80, 20]
    """
    checks.batch_size(batch_size, "batch_size")  # bounded: an absurd size is a typo, not hours of solving
    entries = profile.entries if devices is None else [profile.entry(d) for d in devices]
    if not entries:
        raise ValueError("no devices to split across; give at least one")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    # Solving allocates tens of thousands of small acyclic objects (packed curves, plan lists)
    # for 10,000 devices; with torch imported, the cyclic collector then runs dozens of
    # passes, some over the whole heap (~150 ms on a 2-core VM), inside one solve. None of
    # it can free anything made here, so the collector waits until the plan is built.
    with _collector_paused():
        return _solve(profile, entries, int(batch_size), accumulate)


def _solve(profile: Profile, entries: Sequence[DeviceProfile], batch_size: int, accumulate: bool) -> Plan:
    names = [e.info.name for e in entries]
    table = profile.table(names, [e.curve for e in entries])
    engine = micro_table(table) if accumulate else table
    total_cap = float(engine.cap.sum())
    if total_cap < batch_size:
        caps = ", ".join(f"{n}: {e.curve.memory_cap}" for n, e in zip(names, entries))
        hint = "give devices that hold at least one sample" if accumulate else "or solve(..., accumulate=True)"
        raise ValueError(
            f"batch of {batch_size} exceeds what the devices' memory holds together ({int(total_cap)}: {caps}); "
            f"use a smaller batch, more devices, {hint}"
        )
    sizes = _solve_sizes(engine, batch_size)
    return _make_plan(entries, names, engine, sizes, batch_size, profile.stand_in)


# Beyond this many micro-batches per step a lockstep plan is not searched: the all-gathers
# and reduce-scatters of every micro-batch would cost more than any split saves.
_MAX_LOCKSTEP = 256


def solve_lockstep(profile: Profile, batch_size: int, *, devices: Sequence[DeviceLike] | None = None) -> Plan:
    """The split when every device runs its share as the same number ``k`` of micro-batches (FSDP2).

    Sharded ranks gather parameters and reduce-scatter gradients per micro-batch, so all run
    as many as each other: a device's time is ``k * t(b / k)``. Each ``k`` up to what the
    smallest cap needs is solved and the fastest wins (the smallest on a tie): a fast uncapped
    device pays for extra micro-batches too, so neither the smallest nor the largest fitting
    ``k`` is always best. A share smaller than ``k`` gets fewer micro-batches (fillers weighted 0).
    """
    entries = profile.entries if devices is None else [profile.entry(d) for d in devices]
    caps = [e.curve.memory_cap for e in entries if e.curve.memory_cap]
    if not caps and not any(e.curve.memory_cap is None for e in entries):
        names = [e.info.name for e in entries]
        raise ValueError(f"no device holds even one sample ({names}); give devices with memory for a sample")
    top = 1 if not caps else min(_MAX_LOCKSTEP, max(1, -(-int(batch_size) // min(caps))))
    names = [e.info.name for e in entries]
    best: tuple[int, Plan] | None = None
    for k in range(1, top + 1):
        repeated = dataclasses.replace(
            profile, entries=[dataclasses.replace(e, curve=e.curve.repeated(k)) for e in entries]
        )
        try:
            plan = solve(repeated, batch_size, devices=names)
        except ValueError:  # the caps hold fewer than batch_size samples in k micro-batches
            continue
        if best is None or plan.slowest < best[1].slowest:
            best = (k, plan)
    if best is None:
        raise ValueError(
            f"batch of {batch_size} does not fit the devices' memory in {top} micro-batches ("
            + ", ".join(f"{e.info.name}: {e.curve.memory_cap}" for e in entries)
            + "); use a smaller batch or more devices"
        )
    k, plan = best
    if k > 1:
        plan = dataclasses.replace(plan, micro_batches=[micro_sizes(b, k) for b in plan.sizes])
    return plan


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide, if on) for the ``with`` body, then restore it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def micro_table(table: CurveTable) -> MicroTable:
    """The micro-batched view of ``table``, built once per packed table."""
    cached = table.__dict__.get("micro")
    if cached is None:
        cached = table.__dict__["micro"] = MicroTable(table)
    return cached


def plan_from_sizes(
    profile: Profile | None, devices: Sequence[DeviceLike], sizes: Sequence[int], *, accumulate: bool = False
) -> Plan:
    """Wrap given sizes in a :class:`Plan`, with predicted times when a profile is given.

    Without a profile, devices are named as given (free-form labels allowed) and the times
    are NaN. With ``accumulate=True`` a share beyond a device's cap runs as micro-batches, as
    :func:`solve` would cut it.
    """
    total = sum(int(s) for s in sizes)
    sizes = check_sizes(list(sizes), total, len(devices))
    if profile is None:
        names = [canonical_name(d) for d in devices]
        return Plan(names, sizes, [math.nan] * len(names), total, extrapolated=[False] * len(names))
    entries = [profile.entry(d) for d in devices]
    names = [e.info.name for e in entries]
    table = profile.table(names)
    engine = micro_table(table) if accumulate else table
    return _make_plan(entries, names, engine, np.asarray(sizes, dtype=np.int64), total, profile.stand_in)


def _make_plan(
    entries: Sequence[DeviceProfile],
    names: list[str],
    table: CurveTable | MicroTable,
    sizes: np.ndarray,
    batch_size: int,
    stand_in: str = "",
) -> Plan:
    shares = sizes.tolist()
    micro: list[list[int]] = []  # the plan's default: each share as one batch
    largest = sizes.astype(float)
    if isinstance(table, MicroTable):
        times, counts = table.times_and_counts(sizes)
        split = np.flatnonzero(counts > 1)
        if len(split):
            micro = [[b] if b else [] for b in shares]
            for i, k in zip(split.tolist(), counts[split].tolist()):
                micro[i] = micro_sizes(shares[i], k)
                largest[i] = micro[i][0]
    else:
        times = table.evaluate(largest)
    even = np.asarray(even_sizes(batch_size, len(names)), dtype=float)
    whole = np.full(len(names), float(batch_size))
    if isinstance(table, MicroTable):
        even_time = table.extreme(even, largest=True)[0]
        single_time, best = table.extreme(whole, largest=False)
    else:
        even_time = float(table.evaluate(even).max())
        singles = table.evaluate(whole)
        best = int(np.argmin(singles))
        single_time = float(singles[best])
    return Plan(
        devices=list(names),
        sizes=shares,
        times=times.tolist(),
        batch_size=batch_size,
        even_time=even_time,
        single_time=single_time,
        single_device=names[best],
        extrapolated=(largest > table.x[:, -1]).tolist(),
        emulated=list(dict.fromkeys(n for n, e in zip(names, entries) if e.info.emulated)),
        micro_batches=micro,
        noise=_noise(entries),
        curves=[e.curve for e in entries],
        stand_in=stand_in,
    )


def _noise(entries: Sequence[DeviceProfile]) -> float:
    """The relative ± of a plan's predictions: its noisiest device's (NaN when none says).

    Copies of one device share their measurements, looked at once (a what-if set of 10,000). A
    device whose timings no plan can rest on is refused here.
    """
    seen: dict[int, float | None] = {}
    for e in entries:
        key = id(e.measurements)
        if key not in seen:
            seen[key] = e.noise.relative
    known = [v for v in seen.values() if v is not None]
    return max(known) if known else math.nan


def _solve_sizes(table: CurveTable | MicroTable, batch: int) -> np.ndarray:
    """Exact min-max integer allocation of ``batch`` samples (see :func:`solve`)."""
    n = len(table.cap)
    if isinstance(table, MicroTable):
        hi = table.whole_batch_time(batch)  # one device runs it all: feasible
    else:
        hi = float(table.evaluate(np.minimum(table.cap, batch)).max())  # every device at min(cap, batch)
    lo = 0.0  # nothing fits in zero seconds
    # A safeguarded secant search on the closed-form capacity count F(T), which is nearly
    # linear in T: a handful of vectorised passes instead of ~40 bisections. It starts from
    # the step time of every device running an even share at its throughput there, usually
    # within a few percent; the secant through the last two points aims a little
    # past the root on the side still far from it, so one pass usually closes the bracket;
    # Illinois regula falsi and bisection take over when it leaves the bracket or stalls
    # (caps make F flat in places). Each pass keeps its capacities from below and above,
    # so the bracket's ends need no pass of their own.
    c_lo = c_hi = None
    a_lo, a_hi = 0, math.inf
    w_lo, w_hi = float(-batch), math.inf
    last = [(0.0, w_lo), (0.0, w_lo)]
    side = 0
    # Ranking a few thousand candidates exactly costs microseconds; stop there, or when the
    # bracket is tight but a flat stretch of some curve makes the count jump inside it.
    enough = max(n + 64, 4096)
    width = hi - lo
    guess = _first_guess(table, batch)
    for it in range(200):
        if a_hi - a_lo <= enough or hi - lo <= 1e-9 * hi:
            break
        (t0, v0), (t1, v1) = last
        if it == 0:
            mid = guess
        else:
            aim = -enough / 4 if -w_lo > w_hi else enough / 4  # land on the far side's end
            mid = t1 + (t1 - t0) * (aim - v1) / (v1 - v0) if v1 != v0 else math.nan
        if not lo < mid < hi or (it % 4 == 3 and hi - lo > 0.5 * width):
            width = hi - lo
            secant = it % 4 != 3 and w_lo < w_hi < math.inf
            mid = lo + (hi - lo) * (-w_lo) / (w_hi - w_lo) if secant else 0.5 * (lo + hi)
        if not lo < mid < hi:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
        low, high = _bounds(table, mid, batch)
        a_mid = int(low.sum())
        last = [last[1], (mid, float(a_mid - batch))]
        if a_mid >= batch:
            hi, a_hi, w_hi, c_hi = mid, int(high.sum()), float(a_mid - batch), high
            w_lo = w_lo * 0.5 if side == -1 else w_lo
            side = -1
        else:
            lo, a_lo, w_lo, c_lo = mid, a_mid, float(a_mid - batch), low
            w_hi = w_hi * 0.5 if side == 1 and w_hi < math.inf else w_hi
            side = 1
    # The bracket: capacities from below at ``lo`` (fewer than the batch), from above at
    # ``hi`` (at least the batch); widen it if rounding put it off.
    c_lo = np.zeros(n, dtype=np.int64) if c_lo is None else c_lo
    while c_hi is None or c_hi.sum() < batch:
        if c_hi is not None:
            hi = hi * 2.0 + 1e-12
        c_hi = _bounds(table, hi, batch)[1]
    c_hi = np.minimum(c_hi, batch)
    need = batch - int(c_lo.sum())
    gap = c_hi - c_lo
    if int(gap.sum()) > _ENUMERATE_LIMIT:
        before = np.cumsum(gap) - gap
        filled: np.ndarray = c_lo + np.clip(need - before, 0, gap)
        return filled
    # Each candidate item is "one more sample on device i"; its cost is the device's
    # time with that sample. Within a device costs are non-decreasing, so taking the
    # `need` cheapest items (ties: lower k first) takes a prefix on every device.
    dev = np.repeat(np.arange(n), gap)
    k = np.arange(len(dev)) - np.repeat(np.cumsum(gap) - gap, gap)
    cost = table.evaluate((c_lo[dev] + k + 1).astype(float), dev)
    order = np.lexsort((dev, k, cost))[:need]
    return c_lo + np.bincount(dev[order], minlength=n)


def _bounds(table: CurveTable | MicroTable, seconds: float, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Capacities at ``seconds`` from below and above, settled exactly where they disagree about ``batch``.

    Only then does rounding decide which side of the optimum ``seconds`` lies on, and the
    search needs that side right.
    """
    low, high = table.bounds(seconds)
    # More than the whole batch on one device changes nothing here; clipped, the sums of
    # 10,000 near-flat curves' capacities (up to 1e18 each) cannot overflow.
    low, high = np.minimum(low, batch), np.minimum(high, batch)
    if int(low.sum()) < batch <= int(high.sum()):
        low = high = np.minimum(table.capacity(seconds), batch)
    return low, high


def _first_guess(table: CurveTable | MicroTable, batch: int) -> float:
    """The step time if every device ran an even share (at most its cap) at its throughput there: a start."""
    curves = table.table if isinstance(table, MicroTable) else table
    x = np.clip(np.minimum(batch / len(curves.cap), curves.cap), 1.0, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(table.cap > 0, x / curves.evaluate(x), 0.0)
    total = float(np.nan_to_num(rate, nan=0.0, posinf=0.0).sum())
    return batch / total if total > 0 else math.nan


def allreduce_time(parameter_bytes: float, participants: int, link_gbps: float, *, latency: float = 50e-6) -> float:
    """Predicted seconds of one ring all-reduce of ``parameter_bytes`` gradients over ``link_gbps``.

    A ring sends ``2 (n - 1) / n`` times the bytes over each link in ``2 (n - 1)`` rounds of
    ``latency``; DDP overlaps much of it with the backward, so this is an upper bound.
    """
    if isinstance(participants, bool) or not isinstance(participants, int | np.integer):
        raise TypeError(f"participants must be an integer, got {type(participants).__name__}: {participants!r}")
    if not (math.isfinite(parameter_bytes) and parameter_bytes >= 0):
        raise ValueError(f"the gradients' size must be finite bytes >= 0, got {parameter_bytes!r}")
    if participants <= 1:
        return 0.0
    if not (link_gbps > 0 and math.isfinite(link_gbps)):
        raise ValueError(f"the link bandwidth must be a finite number > 0 Gbit/s, got {link_gbps}")
    n = participants
    return 2 * (n - 1) / n * parameter_bytes / (link_gbps * 1e9 / 8) + 2 * (n - 1) * latency
