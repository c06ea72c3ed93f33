import collections
import dataclasses

import torch

from hetsplit.tree import split_rows


class Encoding(collections.UserDict):
    """A Mapping that is no dict, as a tokenizer's BatchEncoding."""


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str


def test_split_rows_cuts_any_mapping_and_keeps_its_type():
    batch = Encoding({"ids": torch.arange(10).reshape(5, 2), "mask": torch.ones(5)})
    pieces = split_rows(batch, [3, 0, 2])
    assert [type(p) for p in pieces] == [Encoding] * 3
    assert [p["ids"].shape[0] for p in pieces] == [3, 0, 2]
    assert torch.equal(torch.cat([p["ids"] for p in pieces]), batch["ids"])
    assert pieces[2]["ids"].data_ptr() == batch["ids"][3].data_ptr()  # views, no copy


def test_split_rows_with_rows_cuts_only_the_batch_s_tensors():
    shared = torch.arange(7)[None]  # one row of position ids, shared by the batch
    batch = {"x": torch.zeros(4, 7), "position_ids": shared, "scale": torch.tensor(2.0), "name": "b"}
    first, second = split_rows(batch, [1, 3], rows=4)
    assert first["x"].shape == (1, 7) and second["x"].shape == (3, 7)
    assert first["position_ids"] is shared and second["position_ids"] is shared
    assert first["name"] == "b" and first["scale"] is batch["scale"]


def test_split_rows_moves_each_piece_to_its_device_in_one_walk():
    batch = Batch(torch.arange(6.0)[:, None], "a")
    pieces = split_rows(batch, [4, 2], dim=0, devices=[torch.device("cpu"), torch.device("cpu")])
    assert [type(p) for p in pieces] == [Batch, Batch]
    assert [p.x.shape[0] for p in pieces] == [4, 2] and pieces[1].label == "a"


class _KeylessOutput(dict):
    """A model output registered as transformers before 5.11 did: a pytree node without flatten_with_keys_fn."""


torch.utils._pytree.register_pytree_node(
    _KeylessOutput,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: _KeylessOutput(zip(keys, values)),
)


def test_leaf_paths_name_the_leaves_of_a_node_registered_without_keys():
    from hetsplit.tree import leaf_paths

    out = (_KeylessOutput(loss=torch.tensor(1.0), logits=torch.zeros(2, 3)), [torch.ones(2)])
    assert leaf_paths(out) == ["[0]['loss']", "[0]['logits']", "[1][0]"]
    assert leaf_paths({"a": torch.ones(1), "b": (torch.ones(1),)}) == ["['a']", "['b'][0]"]
