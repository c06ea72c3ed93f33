"""Users' journeys through HeteroDataParallel against the plain module (issue 23), property-based.

Hypothesis draws a journey: a model (an MLP, a CNN with BatchNorm, an LSTM at ``dim=1``,
rarely a tiny Hugging Face Llama built from a config), 1-4 devices (``cpu``, ``cpu@x``,
``cpu@x:maxN``), a split source (weights, a profile, none, a plan of the right size), online
rebalancing or not, and a sequence of cycles: training cycles of one or more backwards
before one optimizer step (gather mode, ``train_step``, ``autograd.grad`` of the input or
of the parameters, ``backward(retain_graph=True)`` twice, a gradient penalty with
``create_graph=True``, two forwards before one backward, parameter, post-accumulate and
forward hooks registered mid-journey), evaluation batches under ``no_grad`` (in train or
eval mode), ``set_plan``, and injected failures (in one replica's forward or backward, or a
``KeyboardInterrupt``) that must leave nothing behind. Batch sizes vary: short last
batches, batches smaller than the device count, evaluation batches of other sizes. Some
models carry a bool buffer they set in forward.

The same journey runs on a plain float64 copy of the model, and every gradient, output,
loss, parameter and buffer must agree. For BatchNorm models the reference is the per-shard
one docs/one-process.md defines: the plain module on each shard of ``dp.plan`` separately (a shard's
micro-batches one after another), outputs concatenated; running statistics the
shard-size-weighted average of each shard's update from the same start;
``num_batches_tracked`` +1 per step.

CI runs a fixed, derandomized set of 100 journeys (~60 s on one core); ``HETSPLIT_JOURNEYS=<n>``
runs ``n`` for a long run (with shrinking of a failure) and prints how many ran to the end.
"""

import copy
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import hetsplit
from hetsplit import HeteroDataParallel

# float64 on both sides; the wrapper only cuts the batch and adds per-shard sums in another
# order, so differences are rounding (~1e-15 relative per step). Momentum SGD over a few
# steps keeps them far below 1e-8, while any real defect (a lost, doubled or stale shard,
# a missing hook effect) is off by >1e-3.
RTOL = 1e-8
# The Hugging Face model computes its loss in float32 (transformers casts the logits to float32
# in its loss), so its losses, and the gradients through them, agree to float32 rounding only.
RTOL_HF = 1e-5
LONG = int(os.environ.get("HETSPLIT_JOURNEYS", "0"))
EXAMPLES = LONG or 100  # ~0.3-0.5 s a journey on the 2-vCPU VM

DEVICE_POOL = ["cpu", "cpu@1", "cpu@0.5", "cpu@1:max2", "cpu@1:max3", "cpu@0.5:max4", "cpu@1:max5"]
MODELS = ["mlp", "cnn_bn", "lstm"]  # and, in about one journey in 30, the Hugging Face model (slowest)
SUBSTEPS = [
    "backward",
    "backward",
    "train_step",
    "train_step",
    "grad_x",
    "grad_params",
    "retain",
    "penalty",
    "siamese",
    "hooks",
]
FORWARD_FAIL, BACKWARD_FAIL, INTERRUPT = 1, 2, 3

# -- models ---------------------------------------------------------------------------------------


class _Trap(torch.autograd.Function):
    """Identity; its backward raises in a shard that held a sample flagged for a backward failure."""

    @staticmethod
    def forward(ctx, h, bad):
        ctx.bad = bad
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.bad:
            raise ValueError("injected backward failure")
        return g, None


def _hf_model():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=17,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg)


class Harness(nn.Module):
    """The model under test, plus a per-sample ``flag`` input that injects failures.

    ``flag`` is split like the batch, so a failure happens only in the shard (and the
    micro-batch) holding the flagged sample: 1 raises in forward, 2 in backward, 3 is a
    ``KeyboardInterrupt`` in forward. A zero flag changes nothing.
    """

    def __init__(self, kind: str, seed: int, seen_flag: bool = False) -> None:
        super().__init__()
        self.kind = kind
        if seen_flag:  # a bool buffer set in forward ("has seen data")
            self.register_buffer("seen", torch.tensor(False))
        torch.manual_seed(seed)
        if kind == "mlp":
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        elif kind == "cnn_bn":  # two BatchNorms: the second sees inputs already normalised per shard
            self.net = nn.Sequential(
                nn.Conv2d(1, 3, 3, padding=1),
                nn.BatchNorm2d(3),
                nn.Tanh(),
                nn.Conv2d(3, 3, 3),
                nn.BatchNorm2d(3),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(3 * 2 * 2, 3),
            )
        elif kind == "lstm":  # (time, batch, features): the batch is dim 1
            self.net = nn.LSTM(4, 5)
            self.head = nn.Linear(5, 3)
        else:
            self.net = _hf_model()
        self.double()

    def forward(self, x, flag):
        code = int(flag.max()) if flag.numel() else 0
        if code == FORWARD_FAIL:
            raise ValueError("injected forward failure")
        if code == INTERRUPT:
            raise KeyboardInterrupt
        bad = code == BACKWARD_FAIL
        if hasattr(self, "seen"):
            self.seen.fill_(True)
        if self.kind == "hf":
            emb = _Trap.apply(self.net.get_input_embeddings()(x), bad)
            return self.net(inputs_embeds=emb, labels=x, use_cache=False)
        if self.kind == "lstm":
            return self.head(_Trap.apply(self.net(x)[0], bad))
        return _Trap.apply(self.net(x), bad)


def _hooked(model):
    """The submodule whose forward hooks a journey registers: one returning a tensor, no BatchNorm after it."""
    if model.kind == "hf":
        return model.net.get_input_embeddings()
    return model.head if model.kind == "lstm" else model.net[-1]


def _dim(kind):
    return 1 if kind == "lstm" else 0


def _batch(kind, n, gen):
    """Inputs, targets (``None``: the model's own loss) and a zero flag for ``n`` samples."""
    if kind == "mlp":
        return torch.randn(n, 4, dtype=torch.float64, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    if kind == "cnn_bn":
        x = torch.randn(n, 1, 4, 4, dtype=torch.float64, generator=gen) * 2 + 0.5
        return x, torch.randint(0, 3, (n,), generator=gen)
    if kind == "lstm":
        return torch.randn(3, n, 4, dtype=torch.float64, generator=gen), torch.randint(0, 3, (3, n), generator=gen)
    return torch.randint(0, 17, (n, 5), generator=gen), None


def _flag(kind, n):
    return torch.zeros((1, n) if kind == "lstm" else (n,), dtype=torch.float64)


def _loss(kind, out, y):
    if kind == "hf":
        return out.loss
    if kind == "lstm":
        return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))
    return F.cross_entropy(out, y)


def _main_output(kind, out):
    return out.logits if kind == "hf" else out


# -- the journey ------------------------------------------------------------------------------


@dataclasses.dataclass
class Cycle:
    """One thing a user does: a training cycle (substeps, then one optimizer step), an eval or a failure."""

    kind: str  # "train", "eval" or "fail"
    sizes: list[int]  # batch size of each substep (eval: of each batch)
    substeps: list[str] = dataclasses.field(default_factory=list)
    set_plan: list[int] | None = None  # relative shares of a plan set before the cycle
    eval_mode: bool = False
    failure: int = 0
    fail_mode: str = "backward"
    fail_row: float = 0.0


@dataclasses.dataclass
class Journey:
    """A model, its devices, how the batch is split, and what the user does with it."""

    model: str
    seed: int
    seen_flag: bool  # the model has a bool buffer it sets in forward
    devices: list[str]
    source: str  # "weights", "profile", "none" or "plan"
    shares: list[int]  # the weights, the plan's relative shares, or the profile's relative speeds
    rebalance: str  # "off", "default" (rebalance=True) or "eager" (a Rebalancer re-solving every step)
    first: int  # the usual batch size
    cycles: list[Cycle]


def _some(shares):
    """``shares`` with at least one device holding samples."""
    return shares if any(shares) else [1, *shares[1:]]


@st.composite
def journeys(draw):
    model = "hf" if draw(st.integers(0, 59)) in (17, 41) else draw(st.sampled_from(MODELS))
    devices = draw(st.lists(st.sampled_from(DEVICE_POOL), min_size=1, max_size=4, unique=True))
    n = len(devices)
    shares = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n).map(_some))
    first = draw(st.integers(4, 9))
    # batch sizes: mostly the usual one, then short last batches and batches smaller than the device count
    size = st.one_of(st.just(first), st.just(first), st.integers(1, first - 1), st.integers(1, max(1, n - 1)))
    cycles = []
    for _ in range(draw(st.integers(2, 4))):
        kind = draw(st.sampled_from(["train", "train", "train", "eval", "fail"]))
        if kind == "train":
            subs = draw(st.lists(st.sampled_from(SUBSTEPS), min_size=1, max_size=3))
            sizes = [draw(size) for _ in subs]
            shares_ = draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n).map(_some))
            cycles.append(Cycle("train", sizes, subs, set_plan=shares_))
        elif kind == "eval":
            cycles.append(Cycle("eval", draw(st.lists(size, min_size=1, max_size=2)), eval_mode=draw(st.booleans())))
        else:
            failure = draw(st.sampled_from([FORWARD_FAIL, BACKWARD_FAIL, INTERRUPT]))
            mode = draw(st.sampled_from(["backward", "train_step"]))
            cycles.append(Cycle("fail", [draw(size)], failure=failure, fail_mode=mode, fail_row=draw(st.floats(0, 1))))
    return Journey(
        model=model,
        seed=draw(st.integers(0, 2**16)),
        seen_flag=draw(st.integers(0, 3)) == 1,
        devices=devices,
        source=draw(st.sampled_from(["weights", "weights", "profile", "profile", "none", "plan"])),
        shares=shares,
        rebalance=draw(st.sampled_from(["off", "off", "default", "eager"])),
        first=first,
        cycles=cycles,
    )


# -- plans and the reference ---------------------------------------------------------------------


def _caps(names):
    return [int(name.split(":max")[1]) if ":max" in name else None for name in names]


def _plan(names, batch, shares):
    """A plan for ``batch`` in proportion to ``shares`` (largest remainder), micro-batched within the caps."""
    total = sum(shares)
    exact = [batch * s / total for s in shares]
    sizes = [math.floor(e) for e in exact]
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i] - exact[i])[: batch - sum(sizes)]:
        sizes[i] += 1
    micro = []
    for s, cap in zip(sizes, _caps(names)):
        k = max(1, math.ceil(s / cap)) if cap and s else 1
        micro.append([] if s == 0 else [s // k + (j < s % k) for j in range(k)])
    return hetsplit.Plan(names, sizes, [1e-3 * s for s in sizes], batch, micro_batches=micro)


def _profile(names, shares):
    # A device's speed follows its share (0: ten times slower than the slowest), a fixed cost of 1 ms.
    speed = [s or 0.1 for s in shares]
    data = {n: [(8, 1e-3 + 8e-3 / v), (64, 1e-3 + 64e-3 / v)] for n, v in zip(names, speed)}
    caps = {n: c for n, c in zip(names, _caps(names)) if c}
    return hetsplit.Profile.from_measurements(data, memory_caps=caps or None)


def _shards(dp, batch):
    """The micro-batch sizes of each shard of ``dp.plan`` that holds samples, in device order."""
    plan = dp.plan
    assert plan is not None and plan.batch_size == batch, f"dp.plan is {plan}, but the batch has {batch}"
    micro = plan.micro_batches or [[s] for s in plan.sizes]
    return [[m for m in ms if m > 0] for ms in micro if sum(ms) > 0]


def _run_shards(model, inputs, shards, dim):
    """The plain model on each shard separately (per-shard BatchNorm), outputs concatenated.

    A shard's micro-batches run one after another on one copy of the buffers, as gradient
    accumulation on its device does; every shard starts from the module's buffers. Afterwards
    a floating buffer is the shard-size-weighted average of the shards' values,
    ``num_batches_tracked`` is one more, another integer buffer gains the sum of the shards'
    increments, and a bool buffer is set where any shard set it.
    """
    x, flag = inputs
    sizes = [m for ms in shards for m in ms]
    start = {n: b.clone() for n, b in model.named_buffers()}
    pieces = iter(zip(torch.split(x, sizes, dim), torch.split(flag, sizes, dim)))
    outs, ends = [], []
    for micro in shards:
        bufs = {n: b.clone() for n, b in start.items()}
        for _ in micro:
            outs.append(torch.func.functional_call(model, bufs, next(pieces)))
        ends.append((sum(micro), bufs))
    total = sum(n for n, _ in ends)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if all(torch.equal(b[name], start[name]) for _, b in ends):
                continue
            if name.endswith("num_batches_tracked"):
                buf.add_(1)
            elif buf.is_floating_point():
                buf.copy_(sum(n * b[name] for n, b in ends) / total)
            elif buf.dtype == torch.bool:
                buf.copy_(start[name] | torch.stack([b[name] != start[name] for _, b in ends]).any(0))
            else:
                buf.add_(sum(b[name] - start[name] for _, b in ends))
    return torch.cat(outs, dim)


def _scale(tensors):
    """The largest magnitude in ``tensors`` (``None`` entries skipped), at least a tiny floor."""
    return max([float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()] + [1e-12])


class Runner:
    """Runs one journey on the wrapper and on the plain model side by side, comparing as it goes."""

    def __init__(self, j: Journey) -> None:
        self.j, self.kind, self.dim = j, j.model, _dim(j.model)
        self.plain = Harness(j.model, j.seed, j.seen_flag)
        self.has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.plain.modules())
        names = [d.name for d in hetsplit.parse_devices(j.devices)]
        self.names = names
        kwargs = {}
        profile = _profile(names, j.shares) if j.source == "profile" else None
        if j.source == "weights":
            kwargs["weights"] = j.shares
        elif j.source == "profile":
            kwargs["profile"] = profile
        elif j.source == "plan":
            kwargs["plan"] = _plan(names, self._first_batch(), j.shares)
        kwargs["dim"] = self.dim
        if j.rebalance == "default":
            kwargs["rebalance"] = True
        elif j.rebalance == "eager":
            kwargs["rebalance"] = hetsplit.Rebalancer(profile, every=1, threshold=0.0, window=1)
        self.dp = HeteroDataParallel(copy.deepcopy(self.plain), j.devices, **kwargs)
        self.opt = torch.optim.SGD(self.dp.parameters(), lr=0.05, momentum=0.9)
        self.opt_ref = torch.optim.SGD(self.plain.parameters(), lr=0.05, momentum=0.9)
        self.gen = torch.Generator().manual_seed(j.seed)
        self.plan_shares = j.shares if j.source == "plan" else None  # a plan is in force: one per size

    def _first_batch(self):
        c = self.j.cycles[0]
        return c.sizes[0]

    # - the two sides of one forward -

    def _again(self, run):
        """``run()``, again after a ``StepOutOfMemory`` (a few times), as docs/memory.md says to do.

        With weights (or no split argument) the wrapper does not know an emulated device's cap:
        it halves the cap at each out-of-memory error, and a second one in the same step is an
        error whose step left nothing behind. The plain model has no cap: it runs once.
        """
        for _ in range(4):
            try:
                return run()
            except torch.OutOfMemoryError:
                pass
        return run()

    def _fwd(self, *inputs):
        return self._again(lambda: self.dp(*inputs))

    def _local(self, *args):
        return self._again(lambda: self.dp.train_step(*args))

    def _before(self, batch, shares=None):
        """A plan for this batch when one is in force (or newly set) and it is for another size."""
        if shares is not None:
            self.plan_shares = shares
        if self.plan_shares is None:
            return
        plan = self.dp.plan
        if shares is not None or plan is None or plan.batch_size != batch:
            self.dp.set_plan(_plan(self.names, batch, self.plan_shares))

    def _ref_forward(self, inputs, batch):
        if self.has_bn:
            return _run_shards(self.plain, inputs, _shards(self.dp, batch), self.dim)
        return self.plain(*inputs)

    def _data(self, batch, grad=False):
        x, y = _batch(self.kind, batch, self.gen)
        flag = _flag(self.kind, batch)
        xs = [x.clone().requires_grad_(grad) for _ in range(2)]
        return xs, y, flag

    # - comparisons -

    def _close(self, a, b, what, scale=None):
        """``a`` equals ``b`` to rounding; ``scale``: the largest value of the whole set ``b`` belongs to.

        One scale for a set of tensors (all gradients of the model): some gradients are zero up
        to rounding (a bias in front of BatchNorm), and relative to themselves that is all they are.
        """
        if scale is None:
            scale = float(b.abs().max()) if b.numel() else 1.0
        assert_close(a, b, what, rtol=RTOL_HF if self.kind == "hf" else RTOL, scale=max(scale, 1e-12))

    def _same_grads(self, what):
        scale = _scale(q.grad for q in self.plain.parameters())
        for (name, p), q in zip(self.dp.module.named_parameters(), self.plain.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad {p.grad is not None}, plain {q.grad}"
            if q.grad is not None:
                self._close(p.grad, q.grad, f"{what}: {name}.grad", scale)

    def _same_state(self, what):
        scale = _scale(self.plain.parameters())
        for (name, p), q in zip(self.dp.module.named_parameters(), self.plain.parameters()):
            self._close(p.detach(), q.detach(), f"{what}: {name}", scale)
        for (name, b), c in zip(self.dp.module.named_buffers(), self.plain.buffers()):
            if b.is_floating_point():
                self._close(b, c, f"{what}: buffer {name}")
            else:
                assert torch.equal(b, c), f"{what}: buffer {name} {b} != plain {c}"

    # - the cycles -

    def run(self):
        for i, cycle in enumerate(self.j.cycles):
            what = f"cycle {i} ({cycle.kind} {cycle.substeps or ''} sizes {cycle.sizes})"
            getattr(self, cycle.kind)(cycle, what)
            self._same_state(what)

    def train(self, cycle, what):
        for opt in (self.opt, self.opt_ref):
            opt.zero_grad()
        for k, (sub, batch) in enumerate(zip(cycle.substeps, cycle.sizes)):
            if self.kind == "hf" and sub in ("grad_x", "penalty"):
                sub = "backward"  # token ids have no gradient
            self._before(batch, cycle.set_plan if k == 0 else None)
            getattr(self, f"_{sub}")(batch, f"{what}, {sub} of {batch}")
        self._same_grads(what)
        self.opt.step()
        self.opt_ref.step()

    def _backward(self, batch, what):
        (x, x_ref), y, flag = self._data(batch)
        out = self._fwd(x, flag)
        ref = self._ref_forward((x_ref, flag), batch)
        self._close(_main_output(self.kind, out).detach(), _main_output(self.kind, ref).detach(), f"{what}: output")
        loss, loss_ref = _loss(self.kind, out, y), _loss(self.kind, ref, y)
        self._close(loss.detach(), loss_ref.detach(), f"{what}: loss")
        loss.backward()
        loss_ref.backward()

    def _train_step(self, batch, what):
        (x, x_ref), y, flag = self._data(batch)
        loss_fn = (lambda out: out.loss) if self.kind == "hf" else (lambda out, t: _loss(self.kind, out, t))
        loss = self._local((x, flag), y, loss_fn)
        loss_ref = _loss(self.kind, self._ref_forward((x_ref, flag), batch), y)
        self._close(loss, loss_ref.detach(), f"{what}: loss")
        loss_ref.backward()

    def _grad_x(self, batch, what):
        (x, x_ref), y, flag = self._data(batch, grad=True)
        (g,) = torch.autograd.grad(_loss(self.kind, self._fwd(x, flag), y), x)
        (g_ref,) = torch.autograd.grad(_loss(self.kind, self._ref_forward((x_ref, flag), batch), y), x_ref)
        self._close(g, g_ref, f"{what}: d loss / d x")
        self._same_grads(f"{what} (autograd.grad must leave .grad alone)")

    def _grad_params(self, batch, what):
        (x, x_ref), y, flag = self._data(batch)
        params, params_ref = list(self.dp.parameters()), list(self.plain.parameters())
        grads = torch.autograd.grad(_loss(self.kind, self._fwd(x, flag), y), params)
        ref = self._ref_forward((x_ref, flag), batch)
        grads_ref = torch.autograd.grad(_loss(self.kind, ref, y), params_ref)
        for (name, _), g, g_ref in zip(self.dp.module.named_parameters(), grads, grads_ref):
            self._close(g, g_ref, f"{what}: d loss / d {name}", _scale(grads_ref))
        self._same_grads(f"{what} (autograd.grad must leave .grad alone)")

    def _retain(self, batch, what):
        (x, x_ref), y, flag = self._data(batch)
        loss = _loss(self.kind, self._fwd(x, flag), y)
        loss_ref = _loss(self.kind, self._ref_forward((x_ref, flag), batch), y)
        loss.backward(retain_graph=True)
        loss_ref.backward(retain_graph=True)
        self._same_grads(f"{what}: first backward")
        loss.backward()
        loss_ref.backward()

    def _penalty(self, batch, what):
        (x, x_ref), y, flag = self._data(batch, grad=True)
        for model, xi in ((self.dp, x), (None, x_ref)):
            out = self._fwd(xi, flag) if model is not None else self._ref_forward((xi, flag), batch)
            (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
            (_loss(self.kind, out, y) + 0.1 * g.pow(2).sum()).backward()
        self._close(x.grad, x_ref.grad, f"{what}: x.grad")

    def _hooks(self, batch, what):
        """Parameter hooks (one clamps), post-accumulate hooks and forward hooks, registered now."""
        seen = {"grad": ([], []), "post": ([], []), "forward": ([0], [0])}
        handles = []
        for side, model in enumerate((self.dp.module, self.plain)):
            for name, p in model.named_parameters():
                clamp = lambda g, side=side, name=name: (
                    seen["grad"][side].append((name, g.clone())),
                    g.clamp(-0.1, 0.1),
                )
                handles.append(p.register_hook(lambda g, clamp=clamp: clamp(g)[1]))
                post = lambda p, side=side, name=name: seen["post"][side].append(name)
                handles.append(p.register_post_accumulate_grad_hook(post))
            count = lambda *_, side=side: seen["forward"][side].__setitem__(0, seen["forward"][side][0] + 1)
            handles.append(_hooked(model).register_forward_pre_hook(count))
            handles.append(_hooked(model).register_forward_hook(lambda m, args, out: out * 1.5))
        try:
            self._backward(batch, what)
        finally:
            for h in handles:
                h.remove()
        names = lambda key, side: sorted(n if isinstance(n, str) else n[0] for n in seen[key][side])
        assert names("grad", 0) == names("grad", 1), f"{what}: parameter hooks fired {names('grad', 0)}"
        assert names("post", 0) == names("post", 1), f"{what}: post-accumulate hooks fired {names('post', 0)}"
        assert seen["forward"][0][0] >= 1, f"{what}: a forward pre-hook registered now never fired"
        got = dict(seen["grad"][0])
        for name, g in seen["grad"][1]:
            self._close(got[name], g, f"{what}: gradient a hook of {name} saw", _scale(g for _, g in seen["grad"][1]))

    def _siamese(self, batch, what):
        (x1, x1_ref), y, flag = self._data(batch)
        (x2, x2_ref), _, _ = self._data(batch)
        # each reference forward right after the wrapper's: a rebalancer may change the plan in between
        a, a_ref = self._fwd(x1, flag), self._ref_forward((x1_ref, flag), batch)
        b, b_ref = self._fwd(x2, flag), self._ref_forward((x2_ref, flag), batch)
        for (p, q), ys in (((a, b), y), ((a_ref, b_ref), y)):
            diff = (_main_output(self.kind, p) - _main_output(self.kind, q)).pow(2).mean()
            (_loss(self.kind, p, ys) + diff).backward()

    def eval(self, cycle, what):
        if cycle.eval_mode:
            self.dp.eval()
            self.plain.eval()
        try:
            with torch.no_grad():
                for batch in cycle.sizes:
                    self._before(batch)
                    (x, x_ref), _, flag = self._data(batch)
                    out = self._fwd(x, flag)
                    ref = self._ref_forward((x_ref, flag), batch)
                    got, expected = _main_output(self.kind, out), _main_output(self.kind, ref)
                    self._close(got, expected, f"{what}: eval output of {batch}")
        finally:
            self.dp.train()
            self.plain.train()

    def fail(self, cycle, what):
        """A step that fails in one replica; after zero_grad() the journey goes on as if it never ran."""
        (batch,) = cycle.sizes
        mode, failure = cycle.fail_mode, cycle.failure
        if self.has_bn and mode == "train_step" and failure == BACKWARD_FAIL:
            failure = FORWARD_FAIL  # whether a failed train_step's forward updates the buffers is not specified
        for opt in (self.opt, self.opt_ref):
            opt.zero_grad()
        self._before(batch)
        (x, x_ref), y, flag = self._data(batch)
        row = min(batch - 1, int(cycle.fail_row * batch))
        flag.view(-1)[row] = failure
        injected = KeyboardInterrupt if failure == INTERRUPT else ValueError
        try:
            if mode == "train_step":
                loss_fn = (lambda out: out.loss) if self.kind == "hf" else (lambda o, t: _loss(self.kind, o, t))
                self._local((x, flag), y, loss_fn)
            else:
                _loss(self.kind, self._fwd(x, flag), y).backward()
        except injected as e:
            assert injected is KeyboardInterrupt or "injected" in str(e), f"{what}: not the injected failure: {e!r}"
        else:
            raise AssertionError(f"{what}: the injected failure (code {failure} at row {row}) did not raise")
        try:
            _loss(self.kind, self._ref_forward((x_ref, flag), batch), y).backward()
        except injected:
            pass
        else:
            raise AssertionError(f"{what}: the injected failure did not fail the plain model")
        for opt in (self.opt, self.opt_ref):
            opt.zero_grad()


# -- the test ---------------------------------------------------------------------------------------

_RAN = [0]


@pytest.fixture(scope="module")
def _count_journeys(request):
    """After the module: one line saying how many journeys ran to the end (the count of a long run)."""
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown also when the test passes
        print(f"\ntest_journeys: {_RAN[0]} journeys ran to the end (max_examples={EXAMPLES})")


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    # no explain phase (it writes patch files into the checkout); shrinking only in a long run,
    # where a failure is worth minutes of minimising: in CI the drawn journey is printed as is
    phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if LONG else [])],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(journeys())
def test_journey_equals_the_plain_module(_count_journeys, journey):
    Runner(journey).run()
    _RAN[0] += 1
