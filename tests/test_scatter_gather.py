import dataclasses
from collections import namedtuple

import pytest
import torch

import hetsplit.parallel.scatter_gather as sg
from hetsplit.parallel.scatter_gather import gather, scatter
from hetsplit.tree import batch_length

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"


def _nested(n):
    return {
        "x": torch.randn(n, 3),
        "pair": Pair(torch.arange(n), [torch.ones(n, 2, 2), "keep"]),
        "batch": Batch(torch.randn(n, 1), torch.zeros(n, dtype=torch.long)),
        "scale": 0.5,
    }


def test_uneven_round_trip_with_zero_shard():
    x = torch.randn(10, 4)
    shards = scatter(x, ["cpu", "cpu@0.5", "cpu"], [7, 0, 3])
    assert [s.shape[0] for s in shards] == [7, 0, 3]
    assert torch.equal(gather(shards, "cpu"), x)


def test_nested_round_trip_keeps_structure_and_objects():
    inputs = _nested(9)
    shards = scatter(inputs, ["cpu", "cpu"], [2, 7])
    assert isinstance(shards[1]["pair"], Pair) and isinstance(shards[1]["batch"], Batch)
    assert shards[0]["pair"].b[1] == "keep" and shards[1]["scale"] == 0.5 and shards[1]["batch"].tag == "train"
    assert shards[1]["batch"].x.shape == (7, 1)
    back = gather(shards, "cpu")
    assert torch.equal(back["x"], inputs["x"]) and torch.equal(back["pair"].b[0], inputs["pair"].b[0])
    assert torch.equal(back["batch"].y, inputs["batch"].y)


def test_split_along_another_dim():
    x = torch.randn(2, 10)
    shards = scatter(x, ["cpu", "cpu"], [4, 6], dim=1)
    assert [s.shape for s in shards] == [(2, 4), (2, 6)]
    assert torch.equal(gather(shards, "cpu", dim=1), x)


def test_gradient_flows_through_scatter_and_gather():
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    shards = scatter(x, ["cpu", "cpu@0.25"], [5, 1])
    y = gather([s * (i + 2) for i, s in enumerate(shards)], "cpu")
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[2.0] * 2] * 5 + [[3.0] * 2], dtype=torch.float64))


def test_scalars_are_copied_and_stacked():
    shards = scatter((torch.randn(4), torch.tensor(2.0)), ["cpu", "cpu"], [1, 3])
    assert all(float(s[1]) == 2.0 for s in shards)
    losses = gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert losses.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "inputs, devices, sizes, dim, error, fragment",
    [
        (torch.zeros(5), ["cpu", "cpu"], [2, 2], 0, ValueError, "sum to 4, but the batch has 5"),
        (torch.zeros(5), ["cpu", "cpu"], [6, -1], 0, ValueError, "got -1"),
        (torch.zeros(5), ["cpu", "cpu"], [2.5, 2.5], 0, TypeError, "got float"),
        (torch.zeros(5), ["cpu"], [2, 3], 0, ValueError, "for 1 devices"),
        (torch.zeros(5), ["cpu", "tpu"], [2, 3], 0, ValueError, "'tpu'"),
        ((torch.zeros(5), torch.zeros(4)), ["cpu", "cpu"], [2, 3], 0, ValueError, "[5, 4]"),
        (torch.zeros(5, 2), ["cpu", "cpu"], [2, 3], 2, ValueError, "dim 2 is out of range"),
        ({"a": "no tensor"}, ["cpu"], [1], 0, ValueError, "no tensor"),
    ],
)
def test_bad_input_is_named_before_any_copy(monkeypatch, inputs, devices, sizes, dim, error, fragment):
    moved = []
    monkeypatch.setattr(sg, "to_device", lambda x, d: moved.append(d) or x)
    with pytest.raises(error) as err:
        scatter(inputs, devices, sizes, dim=dim)
    assert fragment in str(err.value)
    assert moved == []


def test_gather_rejects_mismatched_structures():
    with pytest.raises(ValueError, match="different structure"):
        gather([(torch.zeros(1),), [torch.zeros(1)]], "cpu")
    with pytest.raises(ValueError, match="at least one"):
        gather([], "cpu")


def test_batch_length():
    assert batch_length(_nested(4)) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_mix():
    x = torch.randn(10, 3, requires_grad=True)
    shards = scatter(x, ["cuda:0", "cpu"], [8, 2])
    assert shards[0].device.type == "cuda" and shards[1].device.type == "cpu"
    out = gather(shards, "cpu")
    out.sum().backward()
    assert torch.equal(out.detach(), x.detach()) and torch.equal(x.grad, torch.ones_like(x))
