"""The integrations' shared core: one vocabulary, one set of checks, one list of carried loader settings."""

from __future__ import annotations

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import lightning  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import torch
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
import hetsplit.distributed as hd
from hetsplit.accelerate import HeteroAccelerator
from hetsplit.devices import device_name
from hetsplit.integrations import core, loaders, options
from hetsplit.lightning import HeteroDDPStrategy
from hetsplit.planning import Plan, plan_from_sizes
from hetsplit.transformers import HeteroTrainer

MICRO = Plan(["rank0", "rank1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"plan": [6, 2]}, TypeError, "(plan=...) must be a hetsplit Plan, got list"),
        ({"profile": "cpu.json"}, TypeError, "(profile=...) must be a hetsplit Profile, got str"),
        (
            {"global_batch_size": 0},
            ValueError,
            "(global_batch_size=...) must be a positive number of samples per step, got 0",
        ),
        ({"weighting": "mean"}, ValueError, "(weighting='mean'): use one of 'hook', 'outputs'"),
        ({"plan_kwargs": [("weights", [4, 1])]}, TypeError, "(plan_kwargs=...) must be a dict, got list"),
        (
            {"plan": plan_from_sizes(None, ["a", "b"], [6, 2]), "global_batch_size": 16},
            ValueError,
            "global_batch_size=16 but the plan splits 8",
        ),
    ],
)
@pytest.mark.parametrize("integration", [HeteroDDPStrategy, HeteroAccelerator])
def test_the_same_mistake_is_the_same_error_in_every_integration(integration, kwargs, error, fragment):
    with pytest.raises(error, match=f"^{integration.__name__}.*" + fragment.replace("(", r"\(").replace(")", r"\)")):
        integration(**kwargs)


SHARED = [  # the arguments all three take (HeteroTrainer's loss weights by items itself: no weighting=)
    ({"devices": 2}, TypeError, "(devices=...) must be a string such as 'cuda:0,cpu' or a list"),
    ({"plan": [6, 2]}, TypeError, "(plan=...) must be a hetsplit Plan, got list"),
    ({"profile": "cpu.json"}, TypeError, "(profile=...) must be a hetsplit Profile, got str"),
    ({"plan_kwargs": [("weights", [4, 1])]}, TypeError, "(plan_kwargs=...) must be a dict, got list"),
    ({"global_batch_size": 0}, ValueError, "(global_batch_size=...) must be a positive number"),
    ({"rebalance": -1}, ValueError, "(rebalance=-1): give a number of steps >= 1, 0 for no rebalancing"),
    ({"rebalance": True}, ValueError, "(rebalance=True): give a number of steps"),
    ({"plan": MICRO, "rebalance": 2}, ValueError, "(rebalance=2) with a plan with micro-batches"),
]


@pytest.mark.parametrize(("kwargs", "error", "fragment"), SHARED)
@pytest.mark.parametrize("integration", [HeteroDDPStrategy, HeteroAccelerator, HeteroTrainer])
def test_rebalance_devices_and_plans_are_checked_alike_in_all_three(integration, kwargs, error, fragment):
    # Raised by the constructor, before any process group, Trainer or accelerator exists.
    with pytest.raises(error, match=f"^{integration.__name__}.*" + fragment.replace("(", r"\(").replace(")", r"\)")):
        integration(**kwargs)


def test_one_name_for_the_plan_and_the_device_old_names_gone():
    plan = plan_from_sizes(None, ["rank0"], [4])
    acc = HeteroAccelerator(plan=plan, rebalance=hetsplit.Rebalancer(every=3))
    assert acc.plan is plan and acc.rank_device is None and acc.rebalancer is None  # made at the first step
    assert not hasattr(acc, "hetero_plan")
    strategy = HeteroDDPStrategy(plan=plan, rebalance=2)
    assert strategy.plan is plan and strategy.rank_device is None and strategy.rebalance == 2
    assert not hasattr(acc, "hetero_device")


def test_plan_kwargs_have_one_name_and_one_default():
    assert HeteroDDPStrategy().plan_kwargs == options.PLAN_KWARGS
    with pytest.raises(TypeError, match="profile_kwargs= was removed: use plan_kwargs="):
        HeteroDDPStrategy(profile_kwargs={"calibrate": 0})
    assert HeteroAccelerator(plan_kwargs={"weights": [1]}).plan_kwargs == {**options.PLAN_KWARGS, "weights": [1]}


def test_one_cut_for_micro_batches_keeps_shared_values_whole_and_the_mapping_type():
    from hetsplit.distributed.accumulate import micro_sizes_for, row_pieces

    class Encoding(dict):  # a tokenizer's BatchEncoding: a dict subclass the tree walk keeps whole
        pass

    batch = Encoding(ids=torch.arange(6).reshape(6, 1), position_ids=torch.arange(3).reshape(1, 3), tag="x")
    pieces = row_pieces(batch, [2, 2, 2])
    assert all(type(p) is Encoding and p["tag"] == "x" for p in pieces)
    assert [p["ids"].flatten().tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["position_ids"] is batch["position_ids"] for p in pieces)  # not the batch's rows: whole
    assert micro_sizes_for(MICRO, 0, 6) == [2, 2, 2] and micro_sizes_for(MICRO, 0, 5) == [2, 2, 1]  # none above 2
    assert micro_sizes_for(MICRO, 1, 2) == [2] and micro_sizes_for(None, 0, 7) == [7]


def test_every_row_cutter_cuts_any_mapping_namedtuple_and_dataclass_keeping_their_types():
    # accelerate's examples pad with a tokenizer (a BatchEncoding, a UserDict); each cutter of a
    # batch's rows walks it as the one tree walker does, and gives back the same types.
    import collections
    import dataclasses

    from transformers import BatchEncoding

    from hetsplit.integrations.collectives import first_rows
    from hetsplit.integrations.transformers import _rows

    Pair = collections.namedtuple("Pair", "ids mask")

    @dataclasses.dataclass
    class Features:
        ids: torch.Tensor
        note: str

    ids = torch.arange(6).reshape(6, 1)
    batch = BatchEncoding(
        {"enc": BatchEncoding({"input_ids": ids}), "user": collections.UserDict(x=ids + 10),
         "pair": Pair(ids + 20, ids > 2), "feat": Features(ids + 30, "n"), "texts": list("abcdef")}
    )  # fmt: skip
    pieces = list(hd.micro_batches(torch.nn.Linear(1, 1), batch, MICRO, rank=0))
    assert [type(p) for p in pieces] == [BatchEncoding] * 3
    assert [p["enc"]["input_ids"].flatten().tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert type(pieces[1]["enc"]) is BatchEncoding and type(pieces[1]["user"]) is collections.UserDict
    assert pieces[1]["user"]["x"].flatten().tolist() == [12, 13]
    assert type(pieces[2]["pair"]) is Pair and pieces[2]["pair"].ids.flatten().tolist() == [24, 25]
    assert type(pieces[0]["feat"]) is Features and pieces[0]["feat"].ids.flatten().tolist() == [30, 31]
    head = first_rows(batch, 6, 4)  # gather_for_metrics without the padded rows: per-row texts too
    assert type(head) is BatchEncoding and head["texts"] == list("abcd") and type(head["pair"]) is Pair
    assert head["user"]["x"].flatten().tolist() == [10, 11, 12, 13] and head["feat"].note == "n"
    none = _rows(batch, 0)
    assert type(none["user"]) is collections.UserDict and none["feat"].ids.shape == (0, 1)


def test_framework_device_names_are_hetsplit_names():
    assert device_name(torch.device("cpu", 0)) == "cpu"
    assert [device_name(s) for s in ("cpu:0", "cpu:1@0.25", "cpu:max4", "cuda:1")] == [
        "cpu",
        "cpu@0.25",
        "cpu:max4",
        "cuda:1",
    ]


def test_a_recut_loader_keeps_every_carried_setting():
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2, generator=g, in_order=False, num_workers=0)
    carried = loaders.carried_settings(loader)
    assert carried["generator"] is g and carried["in_order"] is False and "pin_memory_device" in carried
    assert "persistent_workers" not in carried  # DataLoader refuses it without workers


def test_a_loader_that_cannot_be_recut_is_refused_alike_by_accelerate_lightning_and_the_trainer():
    """One loader check: the same loader, the same refusal, naming the integration the user made."""
    from torch.utils.data import (
        BatchSampler,
        DistributedSampler,
        IterableDataset,
        SequentialSampler,
        WeightedRandomSampler,
    )

    from hetsplit.integrations.transformers import _TrainerAccelerator  # the accelerator a HeteroTrainer makes

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    data = TensorDataset(torch.arange(8))
    bad = [
        DataLoader(Stream(), batch_size=2),
        DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, False)),
        DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8)),
    ]
    for loader in bad:
        said = {}
        for who, check in [
            ("HeteroAccelerator", lambda x: HeteroAccelerator().prepare_data_loader(x)),
            ("HeteroTrainer", lambda x: _TrainerAccelerator().prepare_data_loader(x)),
            (
                "HeteroDDPStrategy",
                lambda x: loaders.lightning_order(x, "training", strict=True, who="HeteroDDPStrategy"),
            ),
        ]:
            with pytest.raises(ValueError) as info:
                check(loader)
            assert str(info.value).startswith(f"{who} cannot shard the "), info.value
            said[who] = str(info.value).split(" loader: ", 1)[1]
        assert len(set(said.values())) == 1, said
    # Lightning's own DistributedSampler only says the order; anywhere else it is refused as any other sampler.
    spread = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=5))
    assert loaders.lightning_order(spread, "training", strict=True, who="HeteroDDPStrategy") == (True, 5)
    with pytest.raises(ValueError, match="its sampler DistributedSampler cannot be kept"):
        loaders.check_loader(spread, "HeteroAccelerator")


def test_a_sharded_model_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --use_deepspeed sets
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED shards the model instead"):
        HeteroAccelerator()


def test_accelerate_fsdp1_is_refused_and_fsdp2_over_mixed_kinds_of_device_too(monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin

    with pytest.raises(
        ValueError, match=r"fsdp_plugin \(FSDP1\) shards.*FullyShardedDataParallelPlugin\(fsdp_version=2\)"
    ):
        HeteroAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch --use_fsdp --fsdp_version 1
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_FSDP \(FSDP1\) shards the model instead") as info:
        HeteroAccelerator()
    assert "earlier Accelerator" not in str(info.value)
    # ACCELERATE_USE_FSDP without FSDP_VERSION is what accelerate leaves in os.environ once an
    # Accelerator got an fsdp_plugin (an FSDP2 run earlier in this process): the refusal says so.
    monkeypatch.delenv("FSDP_VERSION")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_FSDP \(FSDP1\) shards.*earlier Accelerator of this"):
        HeteroAccelerator()
    # FSDP2 (the plugin, or accelerate launch --fsdp_version 2) shards over one mesh of one kind of
    # device: a GPU process and a CPU process cannot share it. Refused before any work.
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for kwargs in ({}, {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)}):
        with pytest.raises(ValueError, match=r"devices 'cuda:0,cpu' mix cpu and cuda: list devices of one kind"):
            HeteroAccelerator(devices="cuda:0,cpu", **kwargs)


def test_a_device_list_joins_the_job_through_hetsplit_init(monkeypatch):
    # hetsplit.distributed.init chooses the backend for the mix (gloo when a CPU takes part, where
    # accelerate would choose NCCL for its GPU processes) and selects each process's GPU.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    joined = []

    def init(devices=None, **kwargs):
        joined.append(devices)
        raise RuntimeError("joined")  # stop here: no process group in a unit test

    monkeypatch.setattr(hd, "init", init)
    with pytest.raises(RuntimeError, match="joined"):
        HeteroAccelerator(devices="cpu,cpu@0.25")
    assert joined == [["cpu", "cpu@0.25"]]  # the checked names, as a list: not joined to be split again


def test_even_batches_false_is_refused_where_the_plan_weights_the_gradients(monkeypatch):
    from accelerate import DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group starts
    with pytest.raises(ValueError, match=r"even_batches=False keeps a last global batch short.*weighting='none'"):
        HeteroAccelerator(dataloader_config=config)


def test_even_batches_false_runs_alone_and_is_checked_when_set_later(monkeypatch):
    # One process: nothing is weighted across processes, so even_batches=False runs as with plain
    # accelerate. Set on the accelerator after it is made (accelerate's setter), the check still
    # applies where it matters: the loaders of several processes, prepared later.
    from accelerate import DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    try:
        acc = HeteroAccelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=4))
        assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]
        monkeypatch.setattr(HeteroAccelerator, "num_processes", property(lambda self: 2))  # as if launched so
        with pytest.raises(ValueError, match=r"even_batches=False keeps a last global batch short"):
            acc.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=4))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_one_process_keeps_the_last_batch_short_as_plain_accelerate():
    # accelerate pads a last short batch only across processes (even_batches): run alone, a
    # script sees the plain DataLoader's batches, every sample once.
    from accelerate.state import AcceleratorState, GradientState

    try:
        acc = HeteroAccelerator(cpu=True)
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(14)), batch_size=4))
        assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
        # micro_batches runs the short batch whole (a one-process plan has none to cut) ...
        model = torch.nn.Linear(1, 1)
        short = torch.arange(2.0).reshape(2, 1)
        assert [len(piece) for piece in acc.micro_batches(model, short)] == [2]
        # ... and refuses a given plan's micro-batches, which nothing would weight in one process.
        acc.set_plan(Plan(["rank0"], [4], [0.0], 4, micro_batches=[[2, 2]]))
        with pytest.raises(ValueError, match=r"one process: the plan runs micro-batches \[\[2, 2\]\]"):
            acc.micro_batches(model, torch.zeros(4, 1))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_split_report_says_the_split_and_prediction_once_then_the_measured_step(monkeypatch, capsys):
    # One implementation for the three integrations; the clock is the test's.
    import itertools

    clock = itertools.count(0.0, 0.012)  # a step every 12 ms
    monkeypatch.setattr("hetsplit.distributed.report.time.perf_counter", lambda: next(clock))
    monkeypatch.delenv(core.QUIET_ENV, raising=False)
    predicted = Plan(["rank0:cpu", "rank1:cpu@0.25"], [6, 2], [0.010, 0.009], 8)
    report = core.SplitReport("HeteroDDPStrategy", rank=0)
    for _ in range(4):
        report.step(predicted)
    report.end(predicted)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "hetsplit: HeteroDDPStrategy: global batch 8 split rank0:cpu 6 (75%, 10.0 ms), rank1:cpu@0.25 2 (25%, 9.0 ms); "
        "predicted step 10.0 ms; emulated (a real device slowed down or capped, not real hardware): cpu@0.25",
        "hetsplit: HeteroDDPStrategy: measured step 12.0 ms (median of 2 after 1 warm-up, rank 0, start to start), "
        "predicted 10.0 ms (error -17%)",
    ]
    by_hand = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    core.SplitReport("HeteroTrainer", rank=0).step(by_hand, ["rank0:cpu", "rank1:cpu@0.25"])
    assert "no predicted step (shares set by hand" in capsys.readouterr().out
    for report in (core.SplitReport("X", rank=1), core.SplitReport("X", rank=0, quiet=True)):
        report.step(predicted)
        report.step(predicted)
        report.end(predicted)
    monkeypatch.setenv(core.QUIET_ENV, "1")
    core.SplitReport("X", rank=0).step(predicted)
    assert capsys.readouterr().out == ""  # rank 1, quiet=True and HETSPLIT_QUIET=1 say nothing


def test_the_split_report_says_each_line_once_per_run_and_times_the_steps_after_warm_up(monkeypatch, capsys):
    # Three epochs of three steps, each followed by an evaluation (pause): the split is said at the
    # first step only; the measured step is the median of the steps run, the first (warm-up: 100 ms)
    # and the evaluations (1 s) left out, said once at the end.
    now = [0.0]
    monkeypatch.setattr("hetsplit.distributed.report.time.perf_counter", lambda: now[0])
    monkeypatch.delenv(core.QUIET_ENV, raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu@0.25"], [6, 2], [0.010, 0.009], 8)
    report = core.SplitReport("HeteroAccelerator", rank=0)
    steps = iter([0.100, 0.012, 0.016, 0.012, 0.011, 0.013, 0.012, 0.012, 0.030])
    for _ in range(3):
        for _ in range(3):
            report.step(plan)
            now[0] += next(steps)
        report.pause()
        now[0] += 1.0  # evaluation
    report.end()  # the plan of the last step
    report.end(plan)  # the run already ended: nothing more
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "global batch 8 split" in lines[0], lines
    # Timed: 2 steps an epoch (the last one's end is the evaluation's start), less the first.
    assert lines[1] == (
        "hetsplit: HeteroAccelerator: measured step 12.0 ms (median of 5 after 1 warm-up, rank 0, start to start), "
        "predicted 10.0 ms (error -17%, noise ±0%)"
    ), lines
    # One step timed: nothing to leave out, and the line says so.
    report.step(plan)  # a new run says its split again
    now[0] += 0.1
    report.step(plan)
    report.end()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "(1 step, warm-up included, rank 0, start to start)" in lines[1], lines


@pytest.mark.parametrize("integration", ["lightning", "accelerate", "transformers"])
def test_quiet_is_one_shared_option_checked_alike(integration):
    make = {
        "lightning": lambda **kw: HeteroDDPStrategy(**kw),
        "accelerate": lambda **kw: HeteroAccelerator(**kw),
        "transformers": lambda **kw: HeteroTrainer(model=torch.nn.Linear(1, 1), **kw),
    }[integration]
    with pytest.raises(TypeError, match=r"\(quiet=\.\.\.\) must be True or False, got str: 'yes'"):
        make(quiet="yes")


def test_a_profile_file_name_is_refused_with_the_way_to_load_it_in_every_integration():
    # The one source check (planning.sizes.check_source): the integrations used to lose its hint.
    with pytest.raises(TypeError, match=r"HeteroTrainer\(profile=...\) must be a hetsplit Profile.*Profile\.load"):
        options.HeteroOptions(profile="cpu.json").check("HeteroTrainer")


def test_what_rebalancing_may_move_is_one_rule_for_the_integrations_and_torchrun():
    from hetsplit.planning.rebalance import rebalanced_caps

    whole = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    assert rebalanced_caps(whole, None) is None  # whole shares move whole
    core.check_plan("HeteroTrainer", whole, 2, rebalance=3)
    # A plan with micro-batches: the integrations refuse it (they do not follow re-cut micro-batches mid-run),
    # hetsplit.distributed re-solves with them only where every split share's memory cap is known.
    with pytest.raises(ValueError, match=r"^HeteroTrainer\(rebalance=3\) with a plan with micro-batches"):
        core.check_plan("HeteroTrainer", MICRO, 2, rebalance=3)
    with pytest.raises(ValueError, match=r"knows no memory cap for them"):
        rebalanced_caps(MICRO, None)
    # The plan against the world, one message wherever it is checked.
    with pytest.raises(ValueError, match=r"^HeteroAccelerator\(plan=...\) has 2 shares \[6, 2\] but 3 processes run"):
        core.check_plan("HeteroAccelerator", whole, 3)
