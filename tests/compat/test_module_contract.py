"""HeteroDataParallel keeps nn.Module's and nn.DataParallel's contract on everyday code."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from compat_helpers import DEVICES, wrap
from helpers import assert_same_grads
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import hetsplit


class Parent(nn.Module):
    """A model with a wrapped submodule, as Lightning or a user's own code would hold one."""

    def __init__(self):
        super().__init__()
        self.body = wrap(nn.Sequential(nn.Linear(4, 6), nn.Tanh()))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("move", ["to", "cpu", "double", "float", "share_memory", "parent.to", "parent.double"])
def test_module_moves_and_casts_work_on_the_wrapper_and_any_parent(move):
    parent = Parent()
    target = parent if move.startswith("parent.") else parent.body
    method = move.split(".")[-1]
    getattr(target, method)(*(["cpu"] if method == "to" else []))
    dtype = torch.float64 if method == "double" else torch.float32
    parent.to(dtype)
    x = torch.randn(8, 4, dtype=dtype)
    parent(x).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in parent.parameters())


def test_half_moves_the_replicas_too():
    dp = wrap(nn.Linear(4, 3))
    dp(torch.randn(8, 4))  # replicas built in float32
    dp.half()
    assert dp(torch.randn(8, 4).half()).dtype == torch.float16  # rebuilt from the half module, no stale copy


def test_nested_state_dict_has_plain_keys_and_round_trips():
    parent = Parent()
    keys = list(parent.state_dict())
    assert keys == ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
    parent.load_state_dict(parent.state_dict())  # strict
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    plain.load_state_dict(parent.body.state_dict())  # a wrapped checkpoint loads into the plain model
    with torch.no_grad():
        plain[0].weight.add_(1.0)
    parent.body.load_state_dict(plain.state_dict())  # and back
    assert torch.equal(parent.body.module[0].weight, plain[0].weight)
    legacy = {f"module.{k}": v for k, v in plain.state_dict().items()}
    parent.body.load_state_dict(legacy)  # a checkpoint saved with the prefix still loads


def test_deepcopy_and_pickle_give_independent_trainable_copies():
    torch.manual_seed(0)
    dp = wrap(nn.Linear(4, 3))
    x = torch.randn(8, 4)
    dp(x).sum().backward()  # replicas and threads exist now
    for twin in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert all(a is not b for a, b in zip(twin.parameters(), dp.parameters()))
        twin.zero_grad()
        opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        twin(x).sum().backward()
        opt.step()
        assert not torch.equal(twin.module.weight, dp.module.weight)  # trained on its own
        torch.testing.assert_close(twin.module.weight.grad, dp.module.weight.grad)


class Checkpointed(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 2)
        self.seq = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh())

    def forward(self, x):
        if self.mode == "sequential":
            h = checkpoint_sequential(self.seq, 2, x, use_reentrant=False)
        else:
            h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.mode == "reentrant")
        return self.b(h)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "sequential"])
def test_activation_checkpointing_is_exact(mode):
    model = Checkpointed(mode).double()
    ref = copy.deepcopy(model)
    # Reentrant checkpointing needs an input that requires grad, as in plain PyTorch.
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=mode == "reentrant")
    wrap(model)(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert_same_grads(model, ref)


def test_cpu_autocast_bf16():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = wrap(model)(x), ref(x)
        assert out.dtype == expected.dtype == torch.bfloat16
        F.cross_entropy(out.float(), y).backward()
        F.cross_entropy(expected.float(), y).backward()
    # bf16 keeps 8 bits of mantissa: shards change how matmuls accumulate, so agreement is
    # to bf16 precision (~1e-2 of the gradient's scale), not to float64 rounding.
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2 * float(q.grad.abs().max()))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids).mean(1)
        return self.out(torch.tanh(self.mid(torch.tanh(self.mid(h)))))  # mid used twice


def test_tied_and_twice_used_parameters():
    model = Tied().double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 20, (9, 5))
    wrap(model)(ids).logsumexp(1).sum().backward()
    ref(ids).logsumexp(1).sum().backward()
    assert_same_grads(model, ref)
    assert model.out.weight is model.emb.weight


class KeywordsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, *, features, mask, scale=1.0):
        return {"out": self.lin(features) * mask[:, None] * scale, "note": "kw"}


def test_keyword_only_inputs_and_object_outputs():
    model = KeywordsOnly().double()
    ref = copy.deepcopy(model)
    features, mask = torch.randn(8, 3, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    res = wrap(model)(features=features, mask=mask, scale=2.0)
    assert res["note"] == ["kw", "kw"]  # one per replica, never replica 0's alone
    res["out"].sum().backward()
    ref(features=features, mask=mask, scale=2.0)["out"].sum().backward()
    assert_same_grads(model, ref)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)  # reassigned, not in place
        self.seen += x.shape[0]  # in place
        return self.lin(x)


def test_buffers_changed_in_forward_are_merged_as_documented():
    model = Counting().double()
    ref = copy.deepcopy(model)
    x = torch.randn(16, 3, dtype=torch.float64)
    dp = wrap(model)
    dp(x)
    ref(x)
    torch.testing.assert_close(model.ema, ref.ema, rtol=1e-12, atol=1e-15)  # weighted mean of shard means
    assert int(model.seen) == 16  # the sum of the replicas' increments
    dp.eval()
    with torch.no_grad():
        dp(x)
    assert int(model.seen) == 32


def test_train_step_inputs_like_forward_and_a_non_scalar_loss_refused():
    model = KeywordsOnly().double()
    ref = copy.deepcopy(model)
    features, mask = torch.randn(8, 3, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    dp = wrap(model)
    dp.train_step({"features": features}, y, lambda out, t: F.cross_entropy(out["out"], t), mask=mask)
    F.cross_entropy(ref(features=features, mask=mask)["out"], y).backward()
    assert_same_grads(model, ref)
    with pytest.raises(ValueError, match=r"scalar \(0-dim\) tensor, got \(6,\)"):
        dp.train_step({"features": features}, y, lambda out, t: F.cross_entropy(out["out"], t, reduction="none"),
                      mask=mask)  # fmt: skip


def test_a_module_on_two_devices_is_refused_before_any_work():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    # Half on meta: the advice is to materialise it (module.to() cannot move a meta tensor);
    # two real devices are refused in tests/test_data_parallel.py.
    with pytest.raises(ValueError, match=r"the model's '1\.weight' and 1 more are on the meta device"):
        hetsplit.HeteroDataParallel(model, DEVICES)


def test_unconcatenable_outputs_are_refused_naming_the_output():
    class Ragged(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return {"per_sample": self.lin(x), "summary": self.lin(x)[:, : x.shape[0] % 3 + 1]}

    with pytest.raises(ValueError, match=r"output \['summary'\].*cannot be concatenated along dim 0"):
        wrap(Ragged())(torch.randn(8, 3))
