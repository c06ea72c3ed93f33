"""Compatibility-suite helpers: wrap a model in two CPU replicas; the comparisons are tests/helpers.py's."""

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
