"""replicate: each step's replicas take their parameters from the module through autograd, as torch's do."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_grads, batch, mlp
from torch import nn

import hetsplit
from hetsplit.parallel import gather, parallel_apply, replicate, scatter


def _net():
    return mlp(5, 8, 3, batch_norm=True)


def _data(n=20):
    return batch(n, (5,), classes=3)


def test_replicas_backpropagate_into_the_module():
    """The torch recipe — scatter, replicate, parallel_apply, gather — trains the module itself."""
    net, (x, y) = _net(), _data()
    devices = ["cpu", "cpu@1"]
    shards = scatter(x, devices, [12, 8])
    outs = parallel_apply(replicate(net, devices), [(s,) for s in shards], devices=devices)
    F.cross_entropy(gather(outs, "cpu"), y).backward()
    # The per-shard reference: BatchNorm normalises each shard by its own statistics.
    ref = copy.deepcopy(net)
    F.cross_entropy(torch.cat([ref(x[:12]), ref(x[12:])]), y).backward()
    assert_same_grads(net, ref, atol=1e-12)


def test_replicas_share_hooks_and_leave_the_module_alone():
    net, (x, _) = _net(), _data()
    seen = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    before = net[1].running_mean.clone()
    a, b = replicate(net, ["cpu", "cpu"])
    a(x[:4]), b(x[4:10])
    assert seen == [4, 6]  # the module's hooks fire on its replicas
    assert torch.equal(net[1].running_mean, before)  # each replica updated its own copy of the buffers
    assert not torch.equal(a[1].running_mean, before) and not torch.equal(a[1].running_mean, b[1].running_mean)
    assert next(a.parameters()).grad_fn is not None  # a replica's parameter is the module's, through autograd


def test_detached_replicas_do_not_reach_the_module():
    net, (x, _) = _net(), _data()
    (r,) = replicate(net, ["cpu"], detach=True)
    assert not r(x).requires_grad


def test_create_graph_through_a_model_that_draws_random_numbers_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[1, 1])
    x = _data()[0].requires_grad_()
    with pytest.raises(RuntimeError, match="random numbers.*eval"):
        torch.autograd.grad(dp(x).sum(), x, create_graph=True)
    net.eval()  # the penalty's usual form: no dropout, exact
    ref = copy.deepcopy(net)
    xr = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(dp(x).sum(), x, create_graph=True)
    (gr,) = torch.autograd.grad(ref(xr).sum(), xr, create_graph=True)
    g.pow(2).sum().backward()
    gr.pow(2).sum().backward()
    assert_same_grads(net, ref, atol=1e-12)


def test_gradient_penalty_with_batchnorm_and_a_loss_of_the_output():
    """Double backward where the loss's gradient depends on the output: both routes through the replicas."""
    net, (x, y) = _net(), _data()
    ref = copy.deepcopy(net)
    dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[1, 1])
    per_shard = lambda inputs: torch.cat([ref(inputs[:10]), ref(inputs[10:])])  # the per-shard reference
    for model in (dp, per_shard):
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        loss = F.cross_entropy(out, y) + out.pow(2).mean()
        (g,) = torch.autograd.grad(loss, inputs, create_graph=True)
        (loss + g.pow(2).sum()).backward()
    assert_same_grads(net, ref, atol=1e-12)
