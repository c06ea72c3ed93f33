"""Planning: step-time curves, device profiles, the exact split, and online rebalancing.

The public names are what users hold and build (a :class:`Profile`, the :class:`Plan` solved
from it or written by hand, the :class:`Rebalancer` and its :class:`PlanChange`); the package's
own modules import the other names from the modules that define them.
"""

from ..version import no_attribute
from .plan import Plan
from .profile import Profile
from .rebalance import PlanChange, Rebalancer
from .solver import plan_from_sizes, solve

__all__ = [
    "Plan",
    "PlanChange",
    "Profile",
    "Rebalancer",
    "plan_from_sizes",
    "solve",
]

# Documented names removed before the first release, and what replaces each: their AttributeError says so.
_REMOVED = {
    "DeviceProfile": "hetsplit.planning.records.DeviceProfile (a Profile's entries: profile.entry(device))",
    "resolve_plan": "hetsplit.planning.plan_from_sizes(None, devices, sizes), or hetsplit.solve(profile, batch_size)",
}


def __getattr__(name: str) -> object:
    raise no_attribute(__name__, name, _REMOVED)
