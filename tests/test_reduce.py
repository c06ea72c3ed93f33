"""reduce_gradients: the course's allreduce, weighted by shard size, refusing what would be silently wrong."""

import pytest
import torch

from hetsplit import reduce_gradients


def test_reduce_gradients_like_the_course_allreduce_but_weighted():
    a = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    b = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    a[0].grad, a[1].grad = torch.full((2,), 1.0), torch.full((3,), 2.0)
    b[0].grad, b[1].grad = torch.full((2,), 5.0), None
    with pytest.raises(ValueError, match="parameter 1 of device 1 has no gradient"):
        reduce_gradients([a, b], [3, 1])  # a missing gradient is refused, not counted as zero (issue 17)
    b[1].grad = torch.zeros(3)
    reduce_gradients([a, b], [3, 1])
    assert a[0].grad.tolist() == [2.0, 2.0] and b[0].grad.tolist() == [2.0, 2.0]
    assert a[1].grad.tolist() == [1.5] * 3 and b[1].grad.tolist() == [1.5] * 3
    reduce_gradients([a, b], [3, 1], reduction="sum")
    assert a[0].grad.tolist() == [4.0, 4.0]
    with pytest.raises(ValueError, match="differs in shape"):
        reduce_gradients([a, [b[1], b[0]]], [1, 1])
    with pytest.raises(ValueError, match="'max'"):
        reduce_gradients([a, b], [1, 1], reduction="max")


def test_parameters_shared_between_devices_are_refused_naming_them():
    """Two 'devices' on one CPU holding the same tensor would apply every update twice."""
    base = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    aliased = [base[0], base[1].detach().clone().requires_grad_()]
    for p in base + aliased:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="parameter 0 of device 1 shares its storage with parameter 0 of device 0"):
        reduce_gradients([base, aliased], [3, 1])
    assert base[0].grad.tolist() == [1.0, 1.0, 1.0]  # refused before any change


@pytest.mark.parametrize("sizes", [[float("nan"), 2], [-1, 5], [1.5, 2], [True, 2]])
def test_sizes_that_are_not_sample_counts_are_refused(sizes):
    a, b = [torch.zeros(2, requires_grad=True)], [torch.zeros(2, requires_grad=True)]
    a[0].grad, b[0].grad = torch.ones(2), torch.ones(2)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        reduce_gradients([a, b], sizes)


def test_the_course_get_params_on_one_cpu_is_refused_naming_device_copy():
    """d2l's get_params (p.to(device)) on cpu + cpu@0.25 hands both "devices" one tensor: refused, naming the fix."""
    import hetsplit

    devices = hetsplit.parse_devices("cpu,cpu@0.25")
    params = [torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)]
    course = [[p.to(d.torch_device).requires_grad_() for p in params] for d in devices]  # the same tensors twice
    for p in course[0]:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"applied to it twice: give each device its own copy with Device.copy"):
        reduce_gradients(course, [3, 1])
    own = [d.copy(params, requires_grad=True) for d in devices]  # what the guide says
    for ps in own:
        for p in ps:
            p.grad = torch.ones_like(p)
    reduce_gradients(own, [3, 1])
    with torch.no_grad():
        for ps in own:
            for p in ps:
                p -= 0.5 * p.grad
    assert all(torch.equal(a, p - 0.5) and torch.equal(b, p - 0.5) for a, b, p in zip(own[0], own[1], params))


def test_one_shards_weight_is_its_entry_in_the_shard_weights():
    # The engines that know only their own size and the total (a rank, a micro-batch) weight by it.
    from hetsplit.parallel.reduce import shard_weight, shard_weights

    for reduction in ("mean", "sum"):
        assert [shard_weight(s, 8, reduction) for s in (6, 2, 0)] == shard_weights([6, 2, 0], reduction)
    assert shard_weight(0, 0) == 0.0 and shard_weight(0, 0, "sum") == 0.0  # a step without samples weighs nothing
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        shard_weight(1, 2, "max")
