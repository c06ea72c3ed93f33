"""Planning: step-time curves, device profiles, the exact split, and online rebalancing.

``curve`` (a device's step time against batch size) → ``profile`` (the curves of a set
of devices, as data) → ``solver`` (the exact integer split) → ``plan`` (the result) →
``sizes`` (the one policy every engine asks for a batch's shares) → ``rebalance``
(re-solving from measured step times while training).

The public names below are what users hold and build: a :class:`Profile`, the :class:`Plan`
solved from it (:func:`solve`) or written by hand (:func:`plan_from_sizes`), and the
:class:`Rebalancer` with the :class:`PlanChange` it reports. The package's own modules and the
tests import the other names from the modules that define them.
"""

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
