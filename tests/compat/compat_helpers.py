"""Compatibility-suite helpers: wrap a model, compare gradients with a plain single-device reference."""

import copy

import torch

import hetsplit

# cpu@1 is the CPU "emulated" at full speed: a second replica on its own thread with no
# sleeping, so every test exercises the real multi-replica path without slowing down.
DEVICES = ["cpu", "cpu@1"]
WEIGHTS = [3, 1]


def wrap(model, **kwargs):
    """``model`` in HeteroDataParallel over two CPU replicas with a 3:1 split."""
    kwargs.setdefault("weights", WEIGHTS)
    return hetsplit.HeteroDataParallel(model, DEVICES, **kwargs)


def assert_same_grads(model, ref, rtol=1e-9):
    """Every parameter's gradient equals the reference's.

    float64 throughout: the two computations differ only in how the batch is cut and
    summed, so the error is rounding, ~1e-15 relative; 1e-9 leaves room for long
    reductions while still failing on any real weighting error (those are >1e-2).
    """
    pairs = [(n, p, q) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if q.grad is not None]
    assert pairs, "the reference produced no gradient"
    # One scale for the whole model: some gradients are zero up to rounding (a key bias
    # under softmax), and relative to themselves their rounding noise is all there is.
    scale = max(float(q.grad.abs().max()) for _, _, q in pairs) or 1.0
    for name, p, q in pairs:
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=rtol * scale, msg=lambda m, n=name: f"{n}: {m}")


def max_relative_grad_error(model, ref):
    """The largest gradient difference, relative to the reference's largest gradient."""
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    return max(
        float((p.grad - q.grad).abs().max()) / scale
        for p, q in zip(model.parameters(), ref.parameters())
        if q.grad is not None
    )


def train_lowers_loss(dp, step_fn, steps=5, lr=0.05):
    """A few SGD steps through the wrapper on one fixed batch; returns (first, last) loss."""
    opt = torch.optim.SGD(dp.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step_fn(dp)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def round_trips(dp, x_fn):
    """.to(), state_dict into the plain model and back, and deepcopy all keep the same outputs."""
    plain = copy.deepcopy(dp.module)
    with torch.no_grad():
        dp.eval()
        before = x_fn(dp)
        dp.to("cpu")
        plain.load_state_dict(dp.state_dict())  # no `module.` prefix
        dp.load_state_dict(plain.state_dict())
        twin = copy.deepcopy(dp)
        assert all(a is not b for a, b in zip(twin.parameters(), dp.parameters()))
        for candidate in (dp, twin):
            after = x_fn(candidate)
            torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    dp.train()
