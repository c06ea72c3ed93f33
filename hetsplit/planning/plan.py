"""Plan: how a batch is split across devices, and the helpers that produce and check sizes."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .curve import Curve


@dataclasses.dataclass
class Plan:
    """How a batch is split across devices, with the predicted times.

    Attributes:
        devices: Device names, in shard order.
        sizes: Samples per device, same order; they sum to ``batch_size``.
        times: Predicted seconds per device at its size (0 for an unused device).
        batch_size: The whole batch.
        even_time: Predicted step time of the even split (``inf`` if it breaks a memory cap).
        single_time: Predicted step time of the whole batch on the best single device.
        single_device: That device.
        extrapolated: Per device, whether its size lies beyond its largest measured batch.
        emulated: Names of emulated devices in the plan.
        micro_batches: Per device, the sizes of the micro-batches its share runs as, one
            after another with gradients accumulated (``[[64, 64, 63], [40]]``; ``[]`` for
            no samples). Default: the share as one batch.
        noise: The relative ± of the predicted times (the noisiest device's); NaN where
            unknown (sizes given by hand, timings taken once).
        curves: Per device, the step-time curve the plan was solved from (empty for sizes
            given by hand): what a rebalancer without a profile starts from (a torchrun job).
        stand_in: The model whose steps the times time when it is not the model split
            (``"calibration-mlp"``: the quick built-in calibration); :attr:`step_time` is then
            NaN. ``""``: the times are the profiled model's own.
        notes: Lines on shares the planner changed after solving, and why (a device sitting
            out because its share was too small for BatchNorm's statistics).
    """

    devices: list[str]
    sizes: list[int]
    times: list[float]
    batch_size: int
    even_time: float = math.nan
    single_time: float = math.nan
    single_device: str = ""
    extrapolated: list[bool] = dataclasses.field(default_factory=list)
    emulated: list[str] = dataclasses.field(default_factory=list)
    micro_batches: list[list[int]] = dataclasses.field(default_factory=list)
    noise: float = math.nan
    curves: list[Curve] = dataclasses.field(default_factory=list)
    stand_in: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        check_sizes(self.sizes, self.batch_size, len(self.devices))
        if not self.micro_batches:
            self.micro_batches = [[int(s)] if s > 0 else [] for s in self.sizes]
        else:
            self.micro_batches = _check_micro_batches(self.micro_batches, self.sizes)
        if self.curves and len(self.curves) != len(self.devices):
            raise ValueError(f"a plan of {len(self.devices)} devices has {len(self.curves)} curves; give one a device")

    @property
    def step_time(self) -> float:
        """Predicted seconds of the whole step: the slowest device's time (NaN for a stand-in's: :attr:`stand_in`)."""
        return math.nan if self.stand_in else self.slowest

    @property
    def slowest(self) -> float:
        """The slowest device's time in :attr:`times`, whoever's they are: what the solver compares plans by."""
        return max(self.times) if self.times else 0.0

    @property
    def shares(self) -> list[float]:
        """Each device's fraction of the batch."""
        return [s / self.batch_size for s in self.sizes]

    @property
    def speedup_vs_even(self) -> float:
        """Predicted speedup of this plan over the even split."""
        return _ratio(self.even_time, self.step_time)

    @property
    def speedup_vs_single(self) -> float:
        """Predicted speedup of this plan over the best single device alone."""
        return _ratio(self.single_time, self.step_time)

    def noise_notes(
        self, *, step: float | None = None, even: float | None = None, single: float | None = None
    ) -> list[str]:
        """One line for each predicted gain that is inside the measurement noise (:attr:`noise`), else nothing.

        ``step``, ``even`` and ``single`` replace the predicted step times compared (e.g. with
        a modelled gradient exchange added). A comparison with itself says nothing.
        """
        if not (math.isfinite(self.noise) and self.noise >= 0):
            return []
        step = self.step_time if step is None else step
        used = [i for i, s in enumerate(self.sizes) if s > 0]
        alone = len(used) == 1 and self.devices[used[0]] == self.single_device
        cases = [
            (
                "the even split",
                self.even_time if even is None else even,
                self.sizes != even_sizes(self.batch_size, len(self.sizes)),
            ),
            (f"{self.single_device} alone", self.single_time if single is None else single, not alone),
        ]
        notes = []
        for label, other, differs in cases:
            gain = _ratio(other, step) - 1
            if not (differs and math.isfinite(gain)):
                continue
            if abs(gain) <= self.noise:
                notes.append(
                    f"the predicted gain over {label} ({gain:.0%}) is inside the measurement noise (±{self.noise:.0%})"
                )
            elif gain < 0:  # a calibrated step can come out slower than the plain alternative: say so, plainly
                notes.append(
                    f"predicted {-gain:.0%} slower than {label}, beyond the measurement noise (±{self.noise:.0%})"
                )
        return notes

    def to_dict(self) -> dict[str, Any]:
        """Return the plan as a JSON-ready dict (infinite times as ``null``)."""
        data = dataclasses.asdict(self)
        data["noise"] = _finite_or_none(self.noise)
        for key in ("even_time", "single_time"):
            data[key] = _finite_or_none(data[key])
        data["times"] = [_finite_or_none(t) for t in self.times]
        data["step_time"] = _finite_or_none(self.step_time)  # null for a stand-in's times: no step of this model
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build a plan from :meth:`to_dict` output."""

        def num(v: Any) -> float:
            return math.inf if v is None else float(v)

        return cls(
            devices=list(data["devices"]),
            sizes=[int(s) for s in data["sizes"]],
            times=[num(t) for t in data.get("times", [0.0] * len(data["sizes"]))],
            batch_size=int(data["batch_size"]),
            even_time=num(data.get("even_time", math.nan)),
            single_time=num(data.get("single_time", math.nan)),
            single_device=str(data.get("single_device", "")),
            extrapolated=list(data.get("extrapolated", [])),
            emulated=list(data.get("emulated", [])),
            micro_batches=[list(m) for m in data.get("micro_batches") or []],
            noise=math.nan if data.get("noise") is None else float(data["noise"]),  # older files: unknown
            curves=[Curve(**c) for c in data.get("curves") or []],
            stand_in=str(data.get("stand_in") or ""),  # older files: the times were taken as the model's
            notes=[str(n) for n in data.get("notes") or []],
        )


def scaled_step(
    steps: Iterable[tuple[Sequence[float | None], float | Sequence[float]]],
    scales: Sequence[float | None],
    planned: Sequence[float],
) -> float:
    """The median over measured steps of each step as it would have run another plan.

    ``steps``: per step, each device's compute (``None``: not timed) and what the step lasted
    beyond its slowest device (or, per device, a torchrun rank's wall less its compute).
    ``scales``: each device's time on its new share over the measured one (``None``: unknown,
    then its ``planned`` time counts). Taken step by step, not from the medians: the slowest
    of several noisy devices is slower on average than the slowest of their medians
    (predicted from the medians, balanced DDP plans ran 6-10 % longer).
    """
    out = []
    for computes, rest in steps:
        own = list(rest) if isinstance(rest, Sequence) else [0.0] * len(planned)
        longest = 0.0
        for seen, scale, plan_s, extra in zip(computes, scales, planned, own, strict=True):
            if plan_s > 0:
                longest = max(longest, (seen * scale if seen and scale is not None else plan_s) + extra)
        out.append(longest + (0.0 if isinstance(rest, Sequence) else rest))
    if not out:
        raise ValueError("scaled_step needs at least one measured step")
    return float(statistics.median(out))


def _ratio(a: float, b: float) -> float:
    if b <= 0 or math.isnan(a):
        return math.nan
    return a / b


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def check_sizes(sizes: Sequence[Any], total: int, n_devices: int) -> list[int]:
    """Validate shard sizes: one integer >= 0 per device, summing to ``total``; returned as plain ints."""
    if len(sizes) != n_devices:
        raise ValueError(f"got {len(sizes)} sizes {list(sizes)} for {n_devices} devices; give one size per device")
    arr = np.asarray(sizes)
    # The fast path, for the solver's own output.
    no_bools = isinstance(sizes, np.ndarray) or bool not in set(map(type, sizes))
    if arr.dtype.kind in "iu" and arr.ndim == 1 and no_bools and (arr >= 0).all() and int(arr.sum()) == total:
        fast: list[int] = arr.tolist()
        return fast
    out = []
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"size {i} must be an integer, got {type(s).__name__}: {s!r}")
        if s < 0:
            raise ValueError(f"size {i} must be >= 0, got {s}")
        out.append(int(s))
    if sum(out) != total:
        raise ValueError(f"sizes {out} sum to {sum(out)}, but the batch has {total} samples")
    return out


def _check_micro_batches(micro: Sequence[Sequence[Any]], sizes: Sequence[int]) -> list[list[int]]:
    """Validate micro-batch sizes: per device, whole numbers >= 1 summing to its share."""
    if isinstance(micro, str | bytes) or len(micro) != len(sizes):
        raise ValueError(f"micro_batches must hold one list per device ({len(sizes)}), got {micro!r}")
    if all(type(p) is list for p in micro):  # the fast path, for the solver's own output
        flat = list(itertools.chain.from_iterable(micro))
        if set(map(type, flat)) <= {int} and min(flat, default=1) >= 1 and list(map(sum, micro)) == list(sizes):
            return list(map(list, micro))  # copies, as check_sizes does: the plan owns its lists
    out = []
    for i, (parts, size) in enumerate(zip(micro, sizes)):
        ok = not isinstance(parts, str | bytes) and all(
            not isinstance(m, bool) and isinstance(m, int | np.integer) and m >= 1 for m in parts
        )
        if not ok or sum(int(m) for m in parts) != size:
            raise ValueError(
                f"micro_batches[{i}] must be whole numbers >= 1 summing to that device's share {size}, got {parts!r}"
            )
        out.append([int(m) for m in parts])
    return out


def even_sizes(total: int, n: int) -> list[int]:
    """The even split (as ``torch.chunk`` would, but always ``n`` pieces): first pieces get the remainder."""
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def sizes_from_weights(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (>= 0, not all 0) with largest-remainder rounding.

    Ties in the remainder go to earlier devices: ``sizes_from_weights(100, [4, 1])`` is ``[80, 20]``.
    """
    w = np.asarray([float(x) for x in weights], dtype=float)
    if w.size == 0:
        raise ValueError("weights is empty; give one weight per device")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    if w.max() <= 0:
        raise ValueError(f"weights must not all be zero, got {list(weights)}")
    w = w / w.max()  # relative: [1e308, 1e308] is [1, 1], and the sum cannot overflow
    exact = total * w / w.sum()
    sizes = np.floor(exact).astype(np.int64)
    left = total - int(sizes.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - sizes)))  # largest remainder, then earliest
    sizes[order[:left]] += 1
    return [int(s) for s in sizes]
