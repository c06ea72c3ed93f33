"""torchvision and timm CNNs with BatchNorm, against the per-shard reference BatchNorm implies."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from compat_helpers import WEIGHTS, round_trips, train_lowers_loss, wrap
from helpers import assert_same_grads
from torch import nn

BATCH = 32
# What WEIGHTS = [3, 1] gives a batch of 32: 8 samples is the least a share may hold on these
# models' last 1x1 maps (BatchNorm's minimum share, 8 values per channel), so the batch that
# checks a second shard's statistics is 32, not 8 (whose 2-sample share now sits out).
SIZES = [24, 8]


def _torchvision_resnet18():
    return torchvision.models.resnet18(weights=None, num_classes=10).double()


def _timm_cnn():
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=5).double()


MODELS = {"torchvision-resnet18": _torchvision_resnet18, "timm-resnet10t": _timm_cnn}


def _batch(classes):
    # Synthetic images: the shapes of CIFAR, random values.
    return torch.randn(BATCH, 3, 32, 32, dtype=torch.float64), torch.randint(0, classes, (BATCH,))


def _per_shard_reference(model, x, y):
    """What uneven data parallelism computes with BatchNorm in train mode: each shard normalised on its own.

    Returns the reference model (its gradients: loss on the concatenated outputs) and the
    running statistics HeteroDataParallel promises: the shard-size-weighted average of each
    shard's update.
    """
    ref = copy.deepcopy(model)
    outs = [ref(part) for part in torch.split(x, SIZES)]
    F.cross_entropy(torch.cat(outs), y).backward()
    singles = []
    for part in torch.split(x, SIZES):  # each shard's own update, from the same starting state
        single = copy.deepcopy(model)
        with torch.no_grad():
            single(part)
        singles.append(dict(single.named_buffers()))
    stats = {
        name: sum(s[name] * size for s, size in zip(singles, SIZES)) / BATCH
        for name, buf in model.named_buffers()
        if buf.is_floating_point()
    }
    return ref, stats


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_and_running_stats_match_the_per_shard_reference(name):
    model = MODELS[name]()
    classes = model.fc.out_features
    x, y = _batch(classes)
    ref, stats = _per_shard_reference(model, x, y)
    dp = wrap(model)
    F.cross_entropy(dp(x), y).backward()
    assert dp.plan.sizes == SIZES and WEIGHTS == [3, 1]
    assert_same_grads(model, ref)
    for buf_name, expected in stats.items():
        torch.testing.assert_close(model.get_buffer(buf_name), expected, rtol=1e-10, atol=1e-12)
    tracked = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == 1 for b in tracked)  # one step, as in a full-batch run


def test_a_cnn_trains_and_round_trips():
    model = _torchvision_resnet18()
    x, y = _batch(10)
    dp = wrap(model)
    first, last = train_lowers_loss(dp, lambda m: F.cross_entropy(m(x), y), steps=4, lr=0.05)
    assert last < first
    round_trips(dp, lambda m: m(x))


def test_eval_mode_matches_the_plain_model_exactly():
    model = _timm_cnn()
    x, _ = _batch(5)
    dp = wrap(model).eval()
    with torch.no_grad():
        torch.testing.assert_close(dp(x), copy.deepcopy(model).eval()(x), rtol=1e-12, atol=1e-12)
    assert isinstance(dp.module, nn.Module)
