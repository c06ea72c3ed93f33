"""Planning: step-time curves, device profiles, the exact split, and online rebalancing.

``curve`` (a device's step time against batch size) → ``profile`` (the curves of a set
of devices, as data) → ``solver`` (the exact integer split) → ``plan`` (the result) →
``sizes`` (the one policy every engine asks for a batch's shares) → ``rebalance``
(re-solving from measured step times while training).
"""

from .curve import Curve, CurveTable
from .plan import Plan, check_sizes, even_sizes, sizes_from_weights
from .profile import DeviceProfile, Measurement, Profile, latest_profile
from .rebalance import PlanChange, Rebalancer
from .sizes import check_weights, resolve_plan
from .solver import allreduce_time, plan_from_sizes, solve

__all__ = [
    "Curve",
    "CurveTable",
    "DeviceProfile",
    "Measurement",
    "Plan",
    "PlanChange",
    "Profile",
    "Rebalancer",
    "allreduce_time",
    "check_sizes",
    "check_weights",
    "even_sizes",
    "latest_profile",
    "plan_from_sizes",
    "resolve_plan",
    "sizes_from_weights",
    "solve",
]
