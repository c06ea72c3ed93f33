"""torch's private internals, behind one door.

Where torch has no public route for what a step must do exactly, the private name is reached
here and nowhere else, detected by what the installed torch offers (never its version
string). Each entry of :data:`PRIVATE` says what hetsplit uses it for and what happens where
torch lacks it; ``tests/test_torch_door.py`` checks them and that no other module reaches one.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .version import __version__, release

# The oldest torch every feature of hetsplit runs on, as tested (docs/compatibility.md): 2.7
# lacks the caller's saved-tensor hooks that HeteroDataParallel's worker threads must carry.
MIN_TORCH = (2, 8)


def check_version(version: str) -> None:
    """Refuse a torch older than :data:`MIN_TORCH` in one line, before any of its internals is touched."""
    found = release(version, 2)
    if found and found < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"hetsplit {__version__} needs torch >= {need}, but torch {version} is installed; "
            f"upgrade it: pip install 'torch>={need}'"
        )


check_version(torch.__version__)


@dataclasses.dataclass(frozen=True)
class Private:
    """One private torch name hetsplit reaches, and what it costs where torch lacks it.

    ``owner`` is a module, or a class as ``"module:Class"`` (an instance attribute is checked on
    a fresh instance); ``required``: a feature is refused without it (else it goes on, exactly);
    ``since``: the first torch that has it, where newer than hetsplit's floor.
    """

    owner: str
    name: str
    used_for: str
    missing: str = "HeteroDataParallel refuses to step, naming torch 2.8"  # what most of them cost
    required: bool = True
    since: tuple[int, int] | None = None


PRIVATE = [
    Private("torch._C._autograd", "_top_saved_tensors_default_hooks",
            "the caller's saved-tensor hooks, carried into HeteroDataParallel's worker threads"),
    Private("torch._C._autograd", "_saved_tensors_hooks_is_enabled",
            "whether the caller disabled saved-tensor hooks (the worker threads disable them too)"),
    Private("torch._C._autograd", "_saved_tensors_hooks_get_disabled_error_message",
            "the caller's message for disabled saved-tensor hooks", "HeteroDataParallel refuses to step"),
    Private("torch.utils.checkpoint", "_checkpoint_internal_hook",
            "telling a non-reentrant checkpoint's own saved-tensor hooks (_checkpoint_internal, _user_hooks) "
            "from the user's beneath them", "before 2.14 a checkpoint's hooks are the user's own: nothing to tell",
            required=False, since=(2, 14)),
    Private("torch._C._autograd", "_get_current_graph_task_keep_graph",
            "whether a backward keeps its graph (retain_graph): the replicas' graphs are freed when not",
            "the replicas' graphs are kept until the output is dropped (more memory, the same numbers)",
            required=False),
    Private("torch._C", "_are_functorch_transforms_active",
            "refusing a step under torch.func transforms, which do not reach worker threads"),
    Private("torch._dynamo.eval_frame", "OptimizedModule", "carrying torch.compile(module) over to replicas",
            "a compiled module is refused in one line (wrap the uncompiled one)", required=False),
    Private("torch._dynamo.eval_frame", "_TorchDynamoContext", "carrying module.compile() over to replicas",
            "a compiled module is refused in one line (wrap the uncompiled one)", required=False),
    Private("torch._dynamo.external_utils", "wrap_inline", "letting dynamo trace a replica's nn.Module call",
            "a compiled module is refused in one line (wrap the uncompiled one)", required=False),
    Private("torch._dynamo.eval_frame:OptimizedModule", "_orig_mod",
            "comparing a compiled module with the profile of the module it compiled (uncompiled)",
            "a profile of the uncompiled module is refused for the compiled one (another model)", required=False),
    Private("torch.nn.modules.module", "_global_backward_hooks",
            "refusing a global module backward hook, which would fire once per replica"),
    Private("torch.nn.modules.module", "_global_backward_pre_hooks",
            "refusing a global module backward pre-hook, which would fire once per replica"),
    Private("torch.nn:Module", "_backward_hooks", "refusing a module backward hook (it would fire per replica)"),
    Private("torch.nn:Module", "_backward_pre_hooks", "refusing a module backward pre-hook"),
    Private("torch.nn:Module", "_parameters", "a replica's own parameters (as torch.nn.parallel.replicate)"),
    Private("torch.nn:Module", "_buffers", "a replica's own buffers (as torch.nn.parallel.replicate)"),
    Private("torch.nn:Module", "_modules", "a replica's own submodules (as torch.nn.parallel.replicate)"),
    Private("torch.nn:Module", "_replicate_for_data_parallel", "a class's own rule for its replicas"),
    Private("torch:Tensor", "_version", "noticing a forward that wrote into a parameter or an input in place"),
    Private("torch:Tensor", "_base", "telling a view from a tensor of its own", "HeteroDataParallel refuses to step"),
    Private("torch.autograd:Variable", "_execution_engine", "a callback once a backward is done"),
    Private("torch.nn.modules.batchnorm", "_BatchNorm", "every BatchNorm class, user subclasses included",
            "torch's public BatchNorm classes are checked instead", required=False),
    Private("torch.autograd.graph", "_engine_run_backward",
            "noting a rank's out-of-memory error in backward for the other ranks' failure line",
            "off: the peers say only that the rank died", required=False),
    Private("torch.distributed.distributed_c10d", "_get_default_store",
            "the store through which a failing rank leaves its reason for the others",
            "off: the peers say only that the rank died", required=False),
    Private("torch.distributed.elastic.rendezvous.utils", "_matches_machine_hostname",
            "whether node 0 hosts the rendezvous on this machine (torchrun's own rule)",
            "the endpoint's port is not checked before launch", required=False),
]  # fmt: skip


def needs(feature: str, what: str) -> RuntimeError:
    """The one-line error for a feature the installed torch cannot run, naming the torch it needs."""
    need = ".".join(map(str, MIN_TORCH))
    return RuntimeError(
        f"{feature} needs torch >= {need} (installed: {torch.__version__}); this torch lacks {what}. "
        f"Upgrade torch: pip install 'torch>={need}'"
    )


def _attr(owner: str, name: str) -> Any:
    """``owner.name`` (see :class:`Private`), or ``None`` where the installed torch lacks it."""
    module_name, _, cls = owner.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    if cls:
        target = getattr(target, cls, None)
        if target is None:
            return None
        if not hasattr(target, name):  # an instance attribute
            target = _fresh(target)
    return getattr(target, name, None)


def _fresh(cls: Any) -> Any:
    """A fresh instance of ``cls`` to look an instance attribute up on (``cls`` itself where none is made)."""
    if cls is nn.Module:
        return nn.Module()
    if cls is torch.Tensor:
        return torch.empty(0)
    found = dynamo()
    if found is not None and cls is found[0]:
        return torch.compile(nn.Identity())  # an OptimizedModule; nothing is compiled before its first call
    return cls


def missing() -> list[Private]:
    """The entries of :data:`PRIVATE` the installed torch should have (its version past ``since``) and lacks."""
    here = release(torch.__version__, 2)
    return [
        p
        for p in PRIVATE
        if (p.since is None or here >= p.since) and _attr(p.owner, p.name) is None and not _present_as_none(p)
    ]


def _present_as_none(p: Private) -> bool:
    # Tensor._base is None on a tensor that is not a view: present, valued None.
    return p.owner == "torch:Tensor" and p.name == "_base" and hasattr(torch.empty(0), "_base")


# -- HeteroDataParallel's worker threads ---------------------------------------------------

Hooks = tuple[Callable[..., Any], Callable[..., Any]]


def saved_tensors_state() -> tuple[Hooks | None, str | None]:
    """The calling thread's saved-tensor hooks: the top (pack, unpack) pair and, if disabled, torch's message.

    Raises:
        RuntimeError: Where torch cannot say (before 2.8): a worker thread would then save
            activations unlike the plain module, so the step is refused rather than inexact.
    """
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None:
        raise needs("HeteroDataParallel", "torch._C._autograd._top_saved_tensors_default_hooks")
    hooks = top(False)
    off = None if enabled() else autograd._saved_tensors_hooks_get_disabled_error_message()
    return hooks, off


def user_saved_tensors_hooks(hooks: Hooks | None) -> Hooks | None:
    """The (pack, unpack) pair of the user's among ``hooks`` (the calling thread's top pair), or ``None``.

    A non-reentrant checkpoint around the wrapper has its own hooks on top (marked from torch
    2.14), matching the calling thread's saves on recompute; a worker's saves must not join
    that record (their order across threads is not repeatable), so they get the user's beneath.
    """
    while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
        hooks = getattr(hooks[0], "_user_hooks", None)
    return hooks


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``, leaving no hooks behind.

    torch before 2.13 leaves a failed checkpointed forward's saved-tensor hooks pushed in the
    thread that ran it (its generator is closed when collected, maybe in another thread): in
    HeteroDataParallel's persistent workers they packed the next steps' activations (found on
    torch 2.8 by tests/test_journeys.py). The generator is closed here, as torch 2.13 does.
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    try:
        return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None:
            gen = tb.tb_frame.f_locals.get("gen") if tb.tb_frame.f_code is _CHECKPOINT_CODE else None
            if inspect.isgenerator(gen) and gen.gi_frame is not None:
                gen.close()  # exits its `with _checkpoint_hook(...)`: pops the hooks in this thread
            tb = tb.tb_next
        raise


def _checkpoint_code() -> Any:
    """The code of torch's ``checkpoint`` (under its dynamo-disabling wrapper), whose frame holds ``gen``."""
    from torch.utils import checkpoint as module

    return getattr(inspect.unwrap(module.checkpoint), "__code__", None)


_CHECKPOINT_CODE = _checkpoint_code()


def backward_keeps_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph``); ``True`` where torch cannot say."""
    # Not passed to a Function; torch's engine has it, and torch's own compiled functions ask
    # it the same way. Kept where unknown: more memory until the output is dropped, never wrong.
    ask = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if ask is None else bool(ask())


def functorch_transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running in this thread."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is None:
        raise needs("HeteroDataParallel", "torch._C._are_functorch_transforms_active")
    return bool(active())


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward now running is done (torch's engine callback queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- modules and tensors, as torch.nn.parallel.replicate sees them ----------------------------


def backward_hook_owner(module: nn.Module, modules: list[nn.Module]) -> str | None:
    """Where a module backward hook is registered (``"global"`` or the module's name), or ``None``."""
    registry = torch.nn.modules.module
    if registry._global_backward_hooks or registry._global_backward_pre_hooks:
        return "global"
    if any(m._backward_hooks or m._backward_pre_hooks for m in modules):
        return next(n for n, m in module.named_modules() if m._backward_hooks or m._backward_pre_hooks) or "<root>"
    return None


def shallow_replica(m: nn.Module) -> nn.Module:
    """``m._replicate_for_data_parallel()``: a copy sharing ``m``'s attributes and hook dictionaries.

    Done directly for classes that keep torch's rule (nn.Module's setattr made it 20 us per
    submodule and device); a class's own rule is kept.
    """
    if type(m)._replicate_for_data_parallel is not nn.Module._replicate_for_data_parallel:
        own_rule: nn.Module = m._replicate_for_data_parallel()
        return own_rule
    replica = m.__new__(type(m))
    state = m.__dict__.copy()
    state["_parameters"], state["_buffers"], state["_modules"] = {}, dict(m._buffers), dict(m._modules)
    state["_is_replica"] = True
    object.__setattr__(replica, "__dict__", state)  # nn.Module's setattr would inspect it
    return replica


def own_parameters(m: nn.Module) -> dict[str, Any]:
    """``m``'s own parameter slots (name → tensor or ``None``), the dict itself."""
    return m._parameters


def own_buffers(m: nn.Module) -> dict[str, Any]:
    """``m``'s own buffer slots (name → tensor or ``None``), the dict itself."""
    return m._buffers


def own_submodules(m: nn.Module) -> dict[str, Any]:
    """``m``'s own submodule slots (name → module or ``None``), the dict itself."""
    return m._modules


def set_own_parameters(m: nn.Module, slots: dict[str, Any]) -> None:
    """Replace ``m``'s parameter slots with ``slots`` (a replica's, before a class's setattr sees it)."""
    m._parameters = slots


def held(m: nn.Module, name: str) -> Any:
    """What ``m`` holds directly as ``name`` (from its own tables, never ``nn.Module.__getattr__``), or ``None``."""
    for table in ("_modules", "_parameters", "_buffers"):
        slots = m.__dict__.get(table, {})
        if name in slots:
            return slots[name]
    return None


def state_dict_metadata(state_dict: Any) -> dict[str, Any] | None:
    """The per-module metadata torch keeps on a state dict (``state_dict._metadata``), or ``None``."""
    return getattr(state_dict, "_metadata", None)


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it moves on every in-place write into ``t`` or a view sharing it."""
    return int(t._version)


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (``t._base``)."""
    return t._base is not None


def sum_reduction(node: Any) -> tuple[int | None, tuple[int, ...] | None]:
    """What a loss node says of its reduction: (torch's reduction code, the summed input's sizes), ``None`` if not."""
    reduction = getattr(node, "_saved_reduction", None)
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    return (reduction if isinstance(reduction, int) else None), (tuple(sizes) if sizes is not None else None)


def is_batchnorm(m: nn.Module) -> bool:
    """Whether ``m`` is a BatchNorm layer (every subclass of torch's ``_BatchNorm``)."""
    base = getattr(torch.nn.modules.batchnorm, "_BatchNorm", None)
    if base is not None:
        return isinstance(m, base)
    return isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm)


# -- torch.compile ---------------------------------------------------------------------------


def dynamo() -> tuple[type, type, Callable[[Any], Any]] | None:
    """torch's ``OptimizedModule``, its compilation-context class and ``wrap_inline``; ``None`` without them."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext
        from torch._dynamo.external_utils import wrap_inline
    except ImportError:
        return None
    return OptimizedModule, _TorchDynamoContext, wrap_inline


# torch.compile(module) and module.compile() both keep a compiled callable bound to the
# *original* module (an OptimizedModule's forward calls its _orig_mod; module.compile() stores
# torch.compile(module._call_impl)). A replica is a shallow copy of the module, so it would run
# that callable on the original's own parameters. Each replica instead gets the same
# compilation context applied to the replica itself: one compiled wrapper per context, reused
# every step (dynamo's guards accept the new replica objects without recompiling).


def is_compiled(m: nn.Module) -> bool:
    """Whether ``m`` was compiled (``torch.compile(m)`` or ``m.compile()``)."""
    return m.__dict__.get("_compiled_call_impl") is not None or "dynamo_ctx" in m.__dict__


def uncompiled(m: Any) -> Any:
    """The module ``torch.compile(m)`` compiled (its ``_orig_mod``, through any nesting); ``m`` if not compiled.

    That module holds the parameters and defines the model; ``m`` itself when this torch
    cannot say what it wraps.
    """
    found = dynamo()
    while found is not None and isinstance(m, found[0]) and isinstance(m, nn.Module):
        inner = own_submodules(m).get("_orig_mod")
        if not isinstance(inner, nn.Module):
            break
        m = inner
    return m


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
            found = dynamo()
            assert found is not None
            # wrap_inline: dynamo skips torch.nn's own frames unless called from a frame it traces,
            # as torch's OptimizedModule does for torch.nn modules.
            self._calls[key] = (ctx, ctx(found[2](getattr(nn.Module, what))))
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
        found = dynamo()
        ctx = None
        if found is not None and (not optimized or isinstance(original, found[0])):
            ctx = original.__dict__["dynamo_ctx"] if optimized else _context_of(compiled_call, found[1])
        if found is None or not isinstance(ctx, found[1]):
            raise ValueError(
                f"the module {type(original).__name__} was compiled in a way hetsplit cannot carry over to its "
                "replicas on this torch version; wrap the uncompiled module instead"
            )
        if optimized:  # torch.compile(module): its forward calls the replica's _orig_mod, compiled
            inner = own_submodules(replica)["_orig_mod"]
            replica.__dict__["forward"] = functools.partial(self._call(ctx, "__call__"), inner)
        else:  # module.compile(): the replica's own call, compiled
            replica.__dict__["_compiled_call_impl"] = functools.partial(self._call(ctx, "_call_impl"), replica)


# -- torch.distributed -----------------------------------------------------------------------


def default_store() -> Any:
    """The default process group's store, or ``None`` (no group, or a torch that does not say)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:  # the notes it carries are a courtesy, never a new way to fail
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def backend_timeout(group: Any, device: str) -> datetime.timedelta | None:
    """The timeout ``group``'s backend for ``device`` was made with, or ``None`` where torch does not say."""
    try:  # torch keeps it in each backend's options; no public accessor
        timeout = group._get_backend(torch.device(device)).options._timeout
    except Exception:
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def hosts_rendezvous_here(host: str) -> bool | None:
    """torchrun's own rule for whether ``host`` is this machine; ``None`` where torch does not have it."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:
        return None
    return bool(_matches_machine_hostname(host))


_MARK = "_hetsplit_on_backward_error"  # on the wrapper: wrapped once, whoever asks again


def on_backward_error(note: Callable[[BaseException], None]) -> bool:
    """Call ``note(error)`` for every error a backward in this process raises, then raise it unchanged.

    torch's ``_engine_run_backward`` is the one place an autograd error passes through Python
    (``Tensor.backward``, ``torch.autograd.backward`` and ``grad`` all call it); it is wrapped
    once per process, and a successful backward runs through unchanged (bit-equal).

    Returns:
        Whether the note is on: ``False`` where torch lacks the function.
    """
    graph = torch.autograd.graph
    run = getattr(graph, "_engine_run_backward", None)
    if not callable(run):
        return False
    if getattr(run, _MARK, False):
        return True
    wrapped = _noting(run, note)
    graph._engine_run_backward = wrapped
    # torch.autograd imported the name itself (backward() and grad() call it from there).
    if getattr(torch.autograd, "_engine_run_backward", None) is run:
        setattr(torch.autograd, "_engine_run_backward", wrapped)  # noqa: B010
    return True


def _noting(run: Callable[..., Any], note: Callable[[BaseException], None]) -> Callable[..., Any]:
    @functools.wraps(run)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            note(error)
            raise

    setattr(run_backward, _MARK, True)
    return run_backward
