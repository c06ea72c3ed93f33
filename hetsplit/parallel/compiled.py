"""Compiled modules: ``torch.compile(module)`` and ``module.compile()`` carried over to each step's replicas.

Both keep a compiled callable bound to the *original* module (an ``OptimizedModule``'s
``forward`` calls its ``_orig_mod``; ``module.compile()`` stores
``torch.compile(module._call_impl)``). A replica is a shallow copy of the module, so it
would run that callable, and the original module's own parameters rather than the
replica's. Each replica's copy instead gets the same compilation context applied to the
replica itself: one compiled wrapper per context, reused every step (dynamo's guards
accept the new replica objects of the same modules without recompiling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn


def _dynamo() -> tuple[type, type, Callable[[Any], Any]] | None:
    """torch's ``OptimizedModule``, its context class and ``wrap_inline``, or ``None`` without dynamo."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext
        from torch._dynamo.external_utils import wrap_inline
    except ImportError:  # pragma: no cover - a torch without dynamo
        return None
    return OptimizedModule, _TorchDynamoContext, wrap_inline


def _context_of(fn: Callable[..., Any] | None, context_type: type) -> Any:
    """The compilation context behind a ``torch.compile``'d function (its closure's ``self``), or ``None``."""
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None) or ()
    cell = dict(zip(code.co_freevars, closure)).get("self") if code is not None else None
    ctx = cell.cell_contents if cell is not None else None
    return ctx if isinstance(ctx, context_type) else None


class Compiled:
    """Per wrapper: each compilation context's wrapper of a module call, applied to replicas."""

    def __init__(self) -> None:
        self._calls: dict[tuple[int, str], tuple[Any, Callable[..., Any]]] = {}  # keeps each context alive

    def _call(self, ctx: Any, what: str) -> Callable[..., Any]:
        """``ctx`` applied to ``nn.Module.<what>`` taking the module first, made once per context."""
        key = (id(ctx), what)
        if key not in self._calls:
            dynamo = _dynamo()
            assert dynamo is not None
            # wrap_inline: dynamo skips torch.nn's own frames unless called from a frame it traces,
            # as torch's OptimizedModule does for torch.nn modules.
            self._calls[key] = (ctx, ctx(dynamo[2](getattr(nn.Module, what))))
        return self._calls[key][1]

    def attach(self, original: nn.Module, replica: nn.Module) -> None:
        """Give ``replica`` (a shallow copy of ``original``) ``original``'s compilation, run on the replica.

        Raises:
            ValueError: If ``original`` was compiled in a way this torch does not let hetsplit re-apply.
        """
        compiled_call = original.__dict__.get("_compiled_call_impl")
        optimized = "dynamo_ctx" in original.__dict__
        if compiled_call is None and not optimized:
            return
        dynamo = _dynamo()
        ctx = None
        if dynamo is not None and (not optimized or isinstance(original, dynamo[0])):
            ctx = original.__dict__["dynamo_ctx"] if optimized else _context_of(compiled_call, dynamo[1])
        if dynamo is None or not isinstance(ctx, dynamo[1]):
            raise ValueError(
                f"the module {type(original).__name__} was compiled in a way hetsplit cannot carry over to its "
                "replicas on this torch version; wrap the uncompiled module instead"
            )
        if optimized:  # torch.compile(module): its forward calls the replica's _orig_mod, compiled
            replica.__dict__["forward"] = functools.partial(self._call(ctx, "__call__"), replica._modules["_orig_mod"])
        else:  # module.compile(): the replica's own call, compiled
            replica.__dict__["_compiled_call_impl"] = functools.partial(self._call(ctx, "_call_impl"), replica)
