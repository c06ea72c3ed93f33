import pytest
import torch

from hetsplit.devices import Device, describe, device_list, discover, parse_device, parse_devices


@pytest.mark.parametrize(
    "spec, name, speed, emulated",
    [
        ("cpu", "cpu", 1.0, False),
        (" CPU ", "cpu", 1.0, False),
        ("cpu@0.25", "cpu@0.25", 0.25, True),
        ("cpu@1", "cpu@1", 1.0, True),
        ("cpu@.5", "cpu@0.5", 0.5, True),
    ],
)
def test_parse_cpu_forms(spec, name, speed, emulated):
    d = parse_device(spec)
    assert (d.name, d.speed, d.emulated) == (name, speed, emulated)
    assert d.torch_device == torch.device("cpu")


def test_parse_cuda_forms_without_checking():
    assert parse_device("cuda:1", check=False).name == "cuda:1"
    assert parse_device("cuda:0@0.5", check=False).name == "cuda:0@0.5"
    assert parse_device("cuda", check=False).type == "cuda"
    assert parse_device(torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("gpu", "cannot parse device 'gpu'"),
        ("cpu:1", "the CPU has one index, 0; write 'cpu'"),
        ("cpu@0", "must be in (0, 1]"),
        ("cpu@1.5", "must be in (0, 1]"),
        ("cuda:0@-1", "cannot parse"),
    ],
)
def test_parse_rejects_bad_strings(spec, fragment):
    with pytest.raises(ValueError, match=None) as err:
        parse_device(spec)
    assert fragment in str(err.value)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="got int"):
        parse_device(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without this GPU")
def test_unavailable_cuda_is_named():
    with pytest.raises(ValueError, match="'cuda:7' is not available"):
        parse_device("cuda:7")


def test_parse_devices_string_and_list():
    assert [d.name for d in parse_devices("cpu, cpu@0.25")] == ["cpu", "cpu@0.25"]
    assert [d.name for d in parse_devices(["cpu", torch.device("cpu")])] == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="no devices"):
        parse_devices("")


def test_discover_lists_the_cpu_with_memory():
    infos = discover()
    cpu = [i for i in infos if i.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].memory_bytes and cpu[0].memory_bytes > 2**28
    assert all(not i.emulated for i in infos)
    if torch.cuda.is_available():
        assert any(i.kind == "cuda" and i.uuid for i in infos)


def test_describe_labels_emulation():
    info = describe("cpu@0.25")
    assert info.emulated and info.speed == 0.25 and "emulated" in info.description
    assert not describe("cpu").emulated


def test_speed_can_change_over_time():
    dev = parse_device("cpu@0.5")
    try:
        dev.set_speed(0.2)
        assert dev.current_speed == 0.2 and parse_device("cpu@0.5").current_speed == 0.2
        dev.set_speed(None)
        assert dev.current_speed == 0.5
    finally:
        dev.set_speed(None)
    with pytest.raises(ValueError, match="only emulated devices"):
        Device("cpu").set_speed(0.5)


def test_a_copy_on_an_emulated_cpu_never_shares_the_sources_storage():
    """The course's get_params on cpu and cpu@0.25: ``.to(torch_device)`` shared one tensor, updated twice."""
    params = [torch.ones(3), torch.arange(2)]
    replicas = [parse_device(d).copy(params, requires_grad=True) for d in ("cpu", "cpu@0.25")]
    with torch.no_grad():
        for replica in replicas:
            replica[0] -= 0.5  # one SGD update per replica
    assert torch.equal(params[0], torch.ones(3)) and all(torch.equal(r[0], torch.full((3,), 0.5)) for r in replicas)
    assert replicas[0][0].requires_grad and replicas[0][0].is_leaf
    assert not replicas[0][1].requires_grad  # integers record no gradient


def test_a_device_list_is_split_in_one_place():
    assert device_list(" cuda:0, cpu@0.25,,") == ["cuda:0", "cpu@0.25"]
    assert device_list("v100,rank1:cuda:0") == ["v100", "rank1:cuda:0"]  # labels pass unparsed
    assert device_list(" , ") == []
    assert [d.name for d in parse_devices(" cpu , cpu:0@0.5 ,")] == ["cpu", "cpu@0.5"]


def test_a_rank_s_name_in_a_plan_is_written_and_read_by_one_rule():
    from hetsplit.devices import label_device, rank_label

    assert rank_label(1, "cpu@0.25") == "rank1:cpu@0.25" and rank_label(0) == "rank0"
    assert label_device(rank_label(12, "cuda:0")) == "cuda:0" and label_device("rank1:cpu@0.25:max8") == "cpu@0.25:max8"
    assert label_device("rank1") == "rank1" and label_device("cpu@0.25") == "cpu@0.25"  # a hand-set label, a device
    assert label_device("ranked:cpu") == "ranked:cpu"  # no rank number: not a rank's label
