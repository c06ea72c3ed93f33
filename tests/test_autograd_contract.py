"""HeteroDataParallel keeps torch's autograd contract (issue 23): one small test per defect.

The reference is always the plain module running the same code without the wrapper, in
float64. Most tests use two replicas, ``cpu`` (the calling thread) and ``cpu@1`` (a full
speed emulated CPU: a worker thread, no sleeping), so the real multi-replica path runs.

Tolerances: float64 throughout, and the wrapper differs from the plain run only in how the
batch is cut and the per-shard sums are added, so the error is rounding (~1e-15 relative);
``helpers.RTOL`` (1e-9) with an absolute floor scaled to the gradients leaves room for that
while any real defect (a lost or doubled shard, a missing hook, a stale gradient) is off by >1e-2.
"""

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import RTOL, assert_close, assert_same_grads, assert_same_params, batch, mlp
from helpers import step as _step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
from hetsplit import HeteroDataParallel

DEVICES = ["cpu", "cpu@1"]


def _mlp(seed=0):
    return mlp(3, 5, 4, seed=seed)


def _bn_net(seed=0):
    return mlp(3, 5, 4, seed=seed, batch_norm=True)


def _data(n=10, seed=1):
    return batch(n, (3,), classes=4, seed=seed)


def _wrap(net, devices=DEVICES, **kwargs):
    """``net``'s copy in the wrapper; weights [4, 1] unless a split is given (``weights=None``: none)."""
    if "plan" not in kwargs and "profile" not in kwargs and kwargs.get("weights", 0) is not None:
        kwargs.setdefault("weights", [4, 1] if len(devices) == 2 else [1] * len(devices))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return HeteroDataParallel(copy.deepcopy(net), devices, **kwargs)


# -- every batch size ---------------------------------------------------------------------


def _profile():
    curve = [(8, 0.01), (64, 0.05)]
    return hetsplit.Profile.from_measurements({"cpu": curve, "cpu@1": curve})


def _train_over_loaders(dp, net):
    """An epoch over a DataLoader with a short last batch, then an eval loader of another batch size."""
    x, y = _data(22, seed=3)
    ref = copy.deepcopy(net)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (dp, ref))
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)  # 8, 8, 6 (no drop_last)
    for xb, yb in train:
        for o in (opt, opt_ref):
            o.zero_grad()
        F.cross_entropy(dp(xb), yb).backward()
        F.cross_entropy(ref(xb), yb).backward()
        assert_same_grads(dp.module, ref)
        opt.step()
        opt_ref.step()
    assert_same_params(dp.module, ref)
    with torch.no_grad():
        for (xb,) in DataLoader(TensorDataset(x), batch_size=5):  # 5, 5, 5, 5, 2
            assert_close(dp(xb), ref(xb), "eval output")
    # and back to training at the first size
    xb, yb = x[:8], y[:8]
    F.cross_entropy(dp(xb), yb).backward()
    F.cross_entropy(ref(xb), yb).backward()
    assert_same_grads(dp.module, ref)


def test_every_batch_size_with_weights():
    net = _mlp()
    _train_over_loaders(_wrap(net, weights=[4, 1]), net)


def test_every_batch_size_without_a_split_argument():
    net = _mlp()
    _train_over_loaders(_wrap(net, weights=None), net)


def test_every_batch_size_with_rebalance_and_weights():
    net = _mlp()
    _train_over_loaders(_wrap(net, weights=[4, 1], rebalance=True), net)


def test_every_batch_size_with_a_profile():
    net = _mlp()
    _train_over_loaders(_wrap(net, profile=_profile()), net)


def test_no_split_argument_with_a_first_batch_under_no_grad():
    # Evaluating before training (a sanity check of the validation loop) is the first step: the
    # split must not depend on the caller's grad mode. cpu@0.75 is used by no other test, so no
    # split of these devices is cached in this process yet.
    net = _mlp()
    dp = _wrap(net, ["cpu", "cpu@0.75"], weights=None)
    x, y = _data(10)
    with torch.no_grad():
        assert_close(dp(x), net(x), "output under no_grad")
    ref = copy.deepcopy(net)
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert_same_grads(dp.module, ref)


def test_a_plan_for_another_batch_size_is_a_clear_error():
    net = _mlp()
    plan = hetsplit.Plan(["cpu", "cpu@1"], [4, 2], [0.0, 0.0], 6)
    dp = _wrap(net, plan=plan)
    x, _ = _data(10)
    with pytest.raises(ValueError) as err:
        dp(x)
    assert "profile=" in str(err.value) and "weights=" in str(err.value), str(err.value)
    dp(x[:6])  # its own size runs


# -- a failed step leaves nothing behind --------------------------------------------------

POISON_FORWARD, POISON_BACKWARD, POISON_INTERRUPT = 99.0, 55.0, 77.0


class _Trap(torch.autograd.Function):
    """Identity on ``h``; its backward raises when the shard held a poisoned sample."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.bad = bool((x[:, 0] == POISON_BACKWARD).any())
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.bad:
            raise ValueError("poisoned backward")
        return g, None


class _Poisonable(nn.Module):
    """An MLP that fails, in forward or backward, only in the shard holding a poisoned sample."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()

    def forward(self, x):
        if (x[:, 0] == POISON_FORWARD).any():
            raise ValueError("poisoned forward")
        if (x[:, 0] == POISON_INTERRUPT).any():
            raise KeyboardInterrupt
        h = _Trap.apply(self.body[0](x), x)
        return self.body[2](self.body[1](h))


FAILURES = {
    "forward_replica1": (POISON_FORWARD, 9, ValueError),
    "backward_replica0": (POISON_BACKWARD, 0, ValueError),
    "backward_replica1": (POISON_BACKWARD, 9, ValueError),
    "interrupt_replica0": (POISON_INTERRUPT, 0, KeyboardInterrupt),
    "interrupt_replica1": (POISON_INTERRUPT, 9, KeyboardInterrupt),
}


@pytest.mark.parametrize("mode", ["gather", "train_step"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_step_leaves_nothing_behind(failure, mode):
    value, row, kind = FAILURES[failure]
    net = _Poisonable()
    dp = _wrap(net, weights=[4, 1])  # 10 samples: rows 0-7 on cpu, rows 8-9 on cpu@1
    ref = copy.deepcopy(net)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (dp, ref))
    x, y = _data(10)
    bad = x.clone()
    bad[row, 0] = value
    with pytest.raises(kind) as err:
        _step(dp, bad, y, mode)
    if kind is not KeyboardInterrupt:  # the message names the replica and its device
        replica = 0 if row == 0 else 1
        assert f"replica {replica}" in str(err.value) and DEVICES[replica] in str(err.value), str(err.value)
    assert dp.plan.sizes == [8, 2]
    opt.zero_grad()
    opt_ref.zero_grad()
    _step(dp, x, y, mode)
    F.cross_entropy(ref(x), y).backward()
    assert_same_grads(dp.module, ref, f"a good step after a failed one ({failure}, {mode}) and zero_grad(): ")
    opt.step()
    opt_ref.step()
    assert_same_params(dp.module, ref)


def test_no_thread_leak_over_many_failed_steps():
    net = _Poisonable()
    dp = _wrap(net, ["cpu", "cpu@1", "cpu@1"], weights=[2, 1, 1])
    x, y = _data(8)
    dp(x)  # workers started
    base = threading.active_count()
    for i in range(200):
        bad = x.clone()
        bad[7 - i % 3, 0] = (POISON_FORWARD, POISON_BACKWARD, POISON_INTERRUPT)[i % 3]
        with pytest.raises((ValueError, KeyboardInterrupt)):
            _step(dp, bad, y, "gather" if i % 2 else "train_step")
    assert threading.active_count() <= base + 3, (base, threading.active_count())


# -- autograd.grad, retain_graph, double backward ------------------------------------------


def test_autograd_grad_of_the_input_equals_plain_and_leaves_param_grads_none():
    net = _mlp()
    dp = _wrap(net)
    x, y = _data()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(dp(x1), y), x1)
    (g_ref,) = torch.autograd.grad(F.cross_entropy(net(x2), y), x2)
    assert_close(g, g_ref, "d loss / d x")
    written = [n for n, p in dp.named_parameters() if p.grad is not None]
    assert not written, f"autograd.grad(loss, x) wrote the .grad of {written}"
    assert x1.grad is None


def test_autograd_grad_of_the_parameters_equals_plain():
    net = _mlp()
    dp = _wrap(net)
    x, y = _data()
    grads = torch.autograd.grad(F.cross_entropy(dp(x), y), list(dp.parameters()))
    grads_ref = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    for (name, _), g, g_ref in zip(dp.named_parameters(), grads, grads_ref):
        assert_close(g, g_ref, name, scale=max(float(r.abs().max()) for r in grads_ref))
    assert all(p.grad is None for p in dp.parameters()), "autograd.grad(loss, params) wrote .grad"


def test_retain_graph_then_a_second_backward_accumulates_like_plain():
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    loss, loss_ref = F.cross_entropy(dp(x), y), F.cross_entropy(ref(x), y)
    loss.backward(retain_graph=True)
    loss_ref.backward(retain_graph=True)
    assert_same_grads(dp.module, ref)
    loss.backward()
    loss_ref.backward()
    assert_same_grads(dp.module, ref)  # twice the gradient


def test_gradient_penalty_with_create_graph_equals_plain():
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for model, xi in zip((dp, ref), xs):
        out = model(xi)
        (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
        (F.cross_entropy(out, y) + g.pow(2).sum()).backward()
    assert_same_grads(dp.module, ref)
    assert_close(xs[0].grad, xs[1].grad, "x.grad")


# -- hooks -----------------------------------------------------------------------------------


def test_parameter_hooks_fire_once_with_the_full_batch_gradient_and_can_change_it():
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    seen = {"dp": [], "ref": []}
    for key, model in (("dp", dp.module), ("ref", ref)):
        for name, p in model.named_parameters():
            hook = lambda g, key=key, name=name: (seen[key].append((name, g.clone())), g.clamp(-0.05, 0.05))[1]
            p.register_hook(hook)
    for _ in range(2):  # the hooks keep firing, once per backward
        for model in (dp, ref):
            F.cross_entropy(model(x), y).backward()
    names = lambda key: sorted(n for n, _ in seen[key])
    # twice each: once per backward
    assert names("dp") == names("ref"), f"parameter hooks fired for {names('dp')}; plain: {names('ref')}"
    for name, _ in net.named_parameters():
        got = [g for n, g in seen["dp"] if n == name]
        for g, g_ref in zip(got, [g for n, g in seen["ref"] if n == name]):
            assert_close(
                g, g_ref, f"hook's gradient of {name}", scale=max(float(r.abs().max()) for _, r in seen["ref"])
            )
    assert_same_grads(dp.module, ref)  # the clamped gradients, accumulated twice


def test_post_accumulate_grad_hooks_fire_once_per_backward():
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    fired = {"dp": [], "ref": []}
    for key, model in (("dp", dp.module), ("ref", ref)):
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, key=key, name=name: fired[key].append((name, p.grad.clone()))
            )
    for model in (dp, ref):
        F.cross_entropy(model(x), y).backward()
    names = lambda key: sorted(n for n, _ in fired[key])
    assert names("dp") == names("ref"), f"post-accumulate-grad hooks fired for {names('dp')}; plain: {names('ref')}"
    got = dict(fired["dp"])
    for name, g_ref in fired["ref"]:
        assert_close(
            got[name],
            g_ref,
            f".grad seen by the hook of {name}",
            scale=max(float(r.abs().max()) for _, r in fired["ref"]),
        )


@pytest.mark.parametrize("mode", ["gather", "train_step"])
def test_forward_hooks_registered_after_the_first_step_fire(mode):
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    _step(dp, x, y, mode)  # replicas exist now
    dp.zero_grad()
    calls = {"pre": 0, "post": 0}

    def pre(module, args):
        calls["pre"] += 1
        return (args[0] * 2,)

    def post(module, args, out):
        calls["post"] += 1
        return out + 1

    for model in (dp.module, ref):
        model[0].register_forward_pre_hook(pre)
        model[2].register_forward_hook(post)
    _step(dp, x, y, mode)
    assert calls["pre"] >= 1 and calls["post"] >= 1, f"forward hooks registered after the first step: calls {calls}"
    F.cross_entropy(ref(x), y).backward()
    assert_same_grads(dp.module, ref)  # the hooks changed the computation as they do in the plain model
    with torch.no_grad():
        assert_close(dp(x), ref(x), "output with the hooks")


# -- buffers --------------------------------------------------------------------------------


def _per_shard(model, x, sizes):
    """The plain module on each shard separately (BatchNorm statistics per shard), outputs concatenated.

    Running statistics: the shard-size-weighted average of each shard's updated value, every
    shard starting from the same values; ``num_batches_tracked`` +1 for the step.
    """
    start = {n: b.clone() for n, b in model.named_buffers()}
    outs, ends = [], []
    for piece in torch.split(x, [s for s in sizes if s]):
        bufs = {n: b.clone() for n, b in start.items()}
        outs.append(torch.func.functional_call(model, bufs, (piece,)))
        ends.append((len(piece), bufs))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("num_batches_tracked"):
                buf.add_(1)
            elif buf.is_floating_point():
                buf.copy_(sum(n * b[name] for n, b in ends) / len(x))
    return torch.cat(outs)


def test_two_forwards_before_one_backward_with_batchnorm():
    net = _bn_net()
    dp = _wrap(net, weights=[1, 1])
    ref = copy.deepcopy(net)
    x, _ = _data(12)
    x2 = x.flip(0) * 2 + 1
    a, b = dp(x), dp(x2)  # siamese: two forwards, one loss
    ((a - b).pow(2).mean() + a.tanh().sum()).backward()
    sizes = dp.plan.sizes
    a_ref, b_ref = _per_shard(ref, x, sizes), _per_shard(ref, x2, sizes)
    ((a_ref - b_ref).pow(2).mean() + a_ref.tanh().sum()).backward()
    assert_close(a.detach(), a_ref.detach(), "first output")
    assert_close(b.detach(), b_ref.detach(), "second output")
    assert_same_grads(dp.module, ref)
    for (name, buf), buf_ref in zip(dp.module.named_buffers(), ref.buffers()):
        torch.testing.assert_close(buf, buf_ref, rtol=RTOL, atol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    assert int(dp.module[1].num_batches_tracked) == 2


class _SeenFlag(nn.Module):
    """A model that flips a bool buffer in forward (a 'has seen data' flag)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.register_buffer("seen", torch.tensor(False))

    def forward(self, x):
        self.seen.fill_(True)
        return self.body(x)


@pytest.mark.parametrize("mode", ["gather", "train_step"])
def test_a_bool_buffer_changed_in_forward_merges(mode):
    net = _SeenFlag()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    _step(dp, x, y, mode)
    F.cross_entropy(ref(x), y).backward()
    assert dp.module.seen.dtype == torch.bool and bool(dp.module.seen)
    assert_same_grads(dp.module, ref)


@pytest.mark.parametrize("mode", ["gather", "train_step"])
def test_micro_batched_batchnorm_counts_one_per_step(mode):
    net = _bn_net()
    devices = ["cpu", "cpu@1:max4"]
    plan = hetsplit.Plan(["cpu", "cpu:max4"], [4, 12], [0.0, 0.0], 16, micro_batches=[[4], [4, 4, 4]])
    dp = _wrap(net, devices, plan=plan)
    x, y = _data(16)
    for step in (1, 2):
        _step(dp, x, y, mode)
        assert dp.plan.micro_batches == [[4], [4, 4, 4]]
        count = int(dp.module[1].num_batches_tracked)
        assert count == step, f"num_batches_tracked is {count} after {step} micro-batched step(s)"


def test_an_unused_output_leaves_the_parameters_only_it_reaches_without_a_gradient():
    """As with the plain module: a parameter the loss does not reach gets no .grad (not zeros)."""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()

        def forward(self, x):
            return self.a(x), self.b(x)

    net = TwoHeads()
    dp = HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[1, 1])
    dp(torch.randn(6, 4, dtype=torch.float64))[0].sum().backward()
    assert net.a.weight.grad is not None and net.b.weight.grad is None


def test_a_learnable_tensor_outside_the_module_is_refused_not_silently_left_without_gradient():
    outside = torch.randn(4, dtype=torch.float64, requires_grad=True)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).double()

        def forward(self, x):
            return self.lin(x) * outside

    dp = HeteroDataParallel(Scaled(), ["cpu", "cpu@1"], weights=[1, 1])
    with pytest.raises(RuntimeError, match=r"neither parameters of the module nor inputs.*nn.Parameter"):
        dp(torch.randn(6, 4, dtype=torch.float64)).sum().backward()


def test_an_idle_worker_keeps_nothing_of_the_last_step_alive():
    import gc
    import weakref

    net = nn.Sequential(nn.Linear(4, 4)).double()
    seen = []  # the replicas' own outputs (the module's hooks fire on its replicas)
    net[0].register_forward_hook(lambda module, args, output: seen.append(weakref.ref(output)))
    dp = HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[1, 1])
    out = dp(torch.randn(6, 4, dtype=torch.float64))
    out.sum().backward()
    del out
    gc.collect()
    assert len(seen) == 2 and all(ref() is None for ref in seen)  # nothing of the step outlives its output


# -- the caller's autograd state and hooks, as with the plain module (issue 36) --------------------


def test_saved_tensors_hooks_reach_every_replica():
    """Packing activations to fp16 (a saved_tensors_hooks context) applies in every replica's thread."""
    net = _mlp()
    dp = _wrap(net, weights=[3, 1])
    ref = copy.deepcopy(net)
    x, y = _data(24)
    threads, inside = set(), []

    def pack(t):  # written for the plain module: one call at a time
        inside.append(t)
        threads.add(threading.current_thread())
        time.sleep(0.0005)  # long enough for another thread's call to overlap, if one could
        assert len(inside) == 1, "two pack calls at once"
        inside.pop()
        return t.dtype, t.to(torch.float16)

    def unpack(packed):
        return packed[1].to(packed[0])

    for model in (dp, ref):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            F.cross_entropy(model(x), y).backward()
    assert len(threads) == 2  # the caller's and the worker's (was: the caller's only, 9e-6 off)
    assert_same_grads(dp.module, ref, rtol=1e-12)


class _Checkpointed(nn.Module):
    """Reentrant activation checkpointing around its first layer (input without grad) or its middle one."""

    def __init__(self, where):
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.a, self.m, self.b = nn.Linear(3, 5).double(), nn.Linear(5, 5).double(), nn.Linear(5, 4).double()

    def forward(self, x):
        run = lambda layer, t: torch.utils.checkpoint.checkpoint(lambda u: torch.tanh(layer(u)), t, use_reentrant=True)
        if self.where == "first":  # the plain module: no gradient reaches self.a (no input requires grad)
            return self.b(self.m(run(self.a, x)))
        return self.b(run(self.m, torch.tanh(self.a(x))))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("where", ["first", "middle"])
@pytest.mark.parametrize("hook", ["tensor", "post-accumulate"])
def test_reentrant_checkpointing_with_hooks_that_change_gradients_equals_plain(hook, where):
    """Each hook fires as often as on the plain module, with the full-batch gradient (was: a TypeError, None * 0.5).

    The replicas' parameters are leaves of their own, where the checkpoint's inner backward
    accumulates: read there, the sums reach the module through autograd, as in every step.
    """
    net = _Checkpointed(where)
    ref = copy.deepcopy(net)
    calls = {id(net): 0, id(ref): 0}
    for m in (net, ref):

        def halve(g, m=m):
            calls[id(m)] += 1
            return g * 0.5

        def halve_grad(p, m=m):
            calls[id(m)] += 1
            p.grad.mul_(0.5)

        for p in m.parameters():
            if hook == "tensor":
                p.register_hook(halve)
            else:
                p.register_post_accumulate_grad_hook(halve_grad)
    dp = HeteroDataParallel(net, DEVICES, weights=[3, 1])
    for _ in range(2):
        x, y = _data(12)
        F.cross_entropy(dp(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
    assert_same_grads(net, ref)
    assert calls[id(net)] == calls[id(ref)] > 0


def test_a_parameter_no_output_reaches_gets_no_hook_call():
    """Hooks of a parameter the forward leaves unused never fire (was: fired with None)."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 4).double(), nn.Linear(3, 4).double()

        def forward(self, x):
            return self.used(x)

    seen = []
    net = Unused()
    net.unused.weight.register_hook(lambda g: seen.append(g) or g * 0.5)
    dp = HeteroDataParallel(net, DEVICES, weights=[4, 1])
    x, y = _data()
    F.cross_entropy(dp(x), y).backward()
    assert seen == [] and dp.module.unused.weight.grad is None and dp.module.used.weight.grad is not None


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_a_module_backward_hook_is_refused_before_any_replica_runs(kind):
    """It would fire once per replica with a shard's gradients, where the plain module fires once with the batch's."""
    net = _mlp()
    ran = []
    net[0].register_forward_hook(lambda *_: ran.append(1))
    if kind == "full":
        net[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    else:
        net[2].register_full_backward_pre_hook(lambda module, grad_out: None)
    dp = HeteroDataParallel(net, DEVICES, weights=[4, 1])
    x, y = _data()
    with pytest.raises(ValueError, match="module '2' has a backward hook.*once per replica.*p.register_hook"):
        _step(dp, x, y, "gather")
    assert ran == [] and all(p.grad is None for p in net.parameters())
    with torch.no_grad():  # no backward: nothing to refuse
        assert_close(dp(x), net(x), "output under no_grad")


def test_torch_func_transforms_are_refused_and_functional_call_takes_either_names():
    net = _mlp()
    dp = _wrap(net)
    ref = copy.deepcopy(net)
    x, y = _data()
    params = {k: v.detach().clone() for k, v in dp.named_parameters()}
    loss = lambda p: F.cross_entropy(torch.func.functional_call(dp, p, (x,)), y)
    with pytest.raises(RuntimeError, match="inside a torch.func transform.*dp.module"):
        torch.func.grad(loss)(params)  # was: "Cannot access data pointer of Tensor that doesn't have storage"
    # Outside a transform: exact, with the wrapper's own names.
    leaves = {k: v.requires_grad_() for k, v in params.items()}
    grads = torch.autograd.grad(loss(leaves), list(leaves.values()))
    F.cross_entropy(ref(x), y).backward()
    for g, q in zip(grads, ref.parameters()):
        assert_close(g, q.grad, "functional_call gradient")
    assert all(p.grad is None for p in dp.module.parameters())
    # The plain model's names, as dp.state_dict() gives them (was: "HeteroDataParallel has no attribute `0`").
    plain = {k: v.detach().clone().requires_grad_() for k, v in ref.named_parameters()}
    assert sorted(plain) == sorted(k for k in dp.state_dict() if k in plain)
    grads = torch.autograd.grad(loss(plain), list(plain.values()))
    for g, q in zip(grads, ref.parameters()):
        assert_close(g, q.grad, "functional_call gradient, the plain model's names")
    assert all(p.grad is None for p in dp.module.parameters())
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        dp.nothing  # noqa: B018  (a name neither the wrapper nor the module holds)


def test_a_loss_on_an_activation_a_hook_kept_is_refused_not_lost():
    """Such a gradient would stop at a replica's own parameters: refused, in the same backward or the next step."""
    net = _mlp()
    kept = []
    net[1].register_forward_hook(lambda module, args, out: kept.append(out))
    dp = _wrap(net)
    x, y = _data()
    out = dp(x)
    with pytest.raises(RuntimeError, match="other than through the wrapper's output.*return from forward"):
        (F.cross_entropy(out, y) + sum(k.pow(2).sum() for k in kept)).backward(retain_graph=True)
    kept.clear()
    F.cross_entropy(dp(x), y).backward(retain_graph=True)
    sum(k.pow(2).sum() for k in kept).backward()  # a backward of its own: refused at the next step
    with pytest.raises(RuntimeError, match="other than through the wrapper's output"):
        dp(x)
