"""Busy: each device's busy time per step, kept until it can be read without waiting."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from ..planning.plan import Plan
from ..timing import Lap


class BusyLog:
    """The laps of every device in each step, and the finished steps not read yet.

    On the CPU a lap is known when it ends; on a GPU it is known once the device has
    run the step. Finished steps queue here until all their laps can be read, so a
    rebalancer reading them (:meth:`readable`) never makes training wait.
    """

    def __init__(self) -> None:
        self.current: dict[str, list[Lap]] = {}
        self.last: dict[str, list[Lap]] = {}
        self.unread: deque[tuple[Plan, dict[str, list[Lap]]]] = deque()

    def start(self) -> None:
        """Begin a step."""
        self.current = {}

    def add(self, name: str, lap: Lap) -> None:
        """Count ``lap`` as busy time of device ``name`` in this step."""
        self.current.setdefault(name, []).append(lap)

    def end(self, plan: Plan, *, keep: bool) -> None:
        """End the step that ran ``plan``; ``keep`` it for :meth:`readable`."""
        self.last = self.current
        if keep and self.current:
            self.unread.append((plan, self.current))

    def readable(self) -> Iterator[tuple[Plan, dict[str, float]]]:
        """The kept steps, oldest first, whose laps can all be read now: (plan, seconds per device)."""
        while self.unread and all(lap.ready() for laps in self.unread[0][1].values() for lap in laps):
            plan, busy = self.unread.popleft()
            yield plan, {name: sum(lap.seconds() for lap in laps) for name, laps in busy.items()}

    def last_times(self) -> dict[str, float]:
        """Busy seconds of each device in the last finished step (waits for a GPU to finish it)."""
        return {name: sum(lap.seconds() for lap in laps) for name, laps in self.last.items()}
