"""The 2-process job behind tests/test_accelerate.py: each scenario against a single-process reference.

Run by torchrun (or ``accelerate launch``) with 2 processes; prints ``OK <scenario> rank <r>``
per scenario it passes on this rank, or its traceback (``tests/integration_launch.py``).
float64 throughout, so "equal" means to rounding.
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.nn.functional as F
from integration_launch import ACCELERATE_PATTERNS, run_patterns, scenario  # tests/ is the script's folder
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hetsplit.accelerate import HeteroAccelerator
from hetsplit.devices import Device
from hetsplit.planning import Plan, plan_from_sizes

# tests/integration_jobs.py's accelerate patterns first (one checks how a job starts, before
# any accelerator exists), and before the seed below: this job's scenarios draw as they did alone.
run_patterns(ACCELERATE_PATTERNS)

torch.manual_seed(0)
N = 16
X = torch.randn(N, 3, dtype=torch.float64)
Y = torch.randn(N, 1, dtype=torch.float64)
DATA = TensorDataset(torch.arange(N), X, Y)


def model_pair():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    return model, copy.deepcopy(model)


def plan(*sizes):
    return plan_from_sizes(None, ["rank0", "rank1"], list(sizes))


def reference_step(ref, index_batches, lr=0.1):
    """One SGD step of the plain model on the given global batches, gradients averaged over them."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for idx in index_batches:
        (F.mse_loss(ref(X[idx]), Y[idx]) / len(index_batches)).backward()
    opt.step()


def assert_same(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach().cpu() - q.detach()).abs().max().item()
        assert err < 1e-12, f"{what}: parameter {name} differs from the single-process reference by {err}"


@scenario("step")
def _():
    # Shares follow the plan, one epoch covers the data once, one step equals the full-batch step,
    # with both weighting methods.
    for weighting in ("hook", "outputs"):
        acc = HeteroAccelerator(plan=plan(6, 2), weighting=weighting)
        model, ref = model_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4, shuffle=True))
        seen, firsts = [], None
        for step, (idx, xb, yb) in enumerate(loader):
            assert len(idx) == [6, 2][acc.process_index], (weighting, len(idx))
            if step == 0:
                acc.backward(F.mse_loss(model(xb), yb))
                opt.step()
                firsts = acc.gather(idx)
            seen.append(acc.gather_for_metrics(idx))
        assert len(loader) == 2 and sorted(torch.cat(seen).tolist()) == list(range(N)), seen
        reference_step(ref, [firsts])
        assert_same(model, ref, f"weighting={weighting}")


@scenario("accumulate")
def _():
    # accelerate's accumulate(): two global batches, one optimizer step, exact.
    acc = HeteroAccelerator(plan=plan(5, 3), gradient_accumulation_steps=2)
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4))
    batches = []
    for idx, xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
        batches.append(acc.gather(idx))
    assert len(batches) == 2
    reference_step(ref, batches)
    assert_same(model, ref, "gradient accumulation")
    acc.gradient_accumulation_steps = 1


def micro_step(acc, model, opt):
    """Prepare, then run the first batch as ``acc.micro_batches``: the prepared pair, its indices, the sizes run."""
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4, shuffle=True))
    idx, xb, yb = next(iter(loader))
    seen = []
    for xm, ym in acc.micro_batches(model, (xb, yb)):
        seen.append(len(xm))
        acc.backward(F.mse_loss(model(xm), ym))
    return model, opt, idx, seen


@scenario("micro")
def _():
    # A plan that runs process 0's share as micro-batches (solve(..., accumulate=True)): followed
    # with micro_batches, each weighted by its samples, the step equals the full-batch step.
    micro = Plan(["rank0", "rank1"], [5, 3], [0.0, 0.0], 8, micro_batches=[[2, 2, 1], [3]])
    for weighting in ("hook", "outputs"):
        acc = HeteroAccelerator(plan=micro, weighting=weighting)
        model, ref = model_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, idx, seen = micro_step(acc, model, opt)
        assert seen == micro.micro_batches[acc.process_index], seen
        opt.step()
        reference_step(ref, [acc.gather(idx)])
        assert_same(model, ref, f"micro-batches, weighting={weighting}")
    if acc.process_index == 0:  # the whole share in one forward: the error names accelerate's own call
        try:
            model.module(X[:5])  # the weighted module itself (DDP's own forward would wait for rank 1)
        except Exception as e:
            assert "accelerator.micro_batches(model, batch)" in str(e) and "hd." not in str(e), e
        else:
            raise AssertionError("a forward off the plan's micro-batches was taken")
    try:
        HeteroAccelerator(plan=micro, weighting="none")
    except ValueError as e:
        assert "micro-batches [2, 2, 1]" in str(e), e
    else:
        raise AssertionError("an unweighted accelerator took a plan with micro-batches")


@scenario("micro_hf")
def _():
    # The same on code nobody here wrote: a Hugging Face BERT built from a config, its own loss.
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ref = transformers.BertForSequenceClassification(cfg).double()
    ids, labels = torch.randint(0, 50, (N, 8)), torch.randint(0, 3, (N,))
    micro = Plan(["rank0", "rank1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    acc = HeteroAccelerator(plan=micro)
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    # As accelerate's nlp_example.py batches: tokenizer.pad(..., return_tensors="pt"), a BatchEncoding.
    def collate(items):
        idx, x, y = (torch.stack(column) for column in zip(*items))
        return transformers.BatchEncoding({"idx": idx, "input_ids": x, "labels": y})

    data = DataLoader(TensorDataset(torch.arange(N), ids, labels), batch_size=4, collate_fn=collate)
    model, opt, loader = acc.prepare(model, opt, data)
    batch = next(iter(loader))
    idx = batch.pop("idx")
    for micro in acc.micro_batches(model, batch):
        assert type(micro) is transformers.BatchEncoding, type(micro)
        acc.backward(model(**micro).loss)
    opt.step()
    every = acc.gather(idx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(input_ids=ids[every], labels=labels[every]).loss.backward()
    ref_opt.step()
    assert_same(model, ref, "micro-batches on BERT")


@scenario("zero")
def _():
    # A process the plan gives nothing still takes part in every step; gradients stay exact.
    acc = HeteroAccelerator(plan=plan(8, 0))
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4))
    idx, xb, yb = next(iter(loader))
    assert len(idx) == [8, 2][acc.process_index]  # a share of 0: two real samples, weighted 0
    acc.backward(F.mse_loss(model(xb), yb))
    opt.step()
    reference_step(ref, [acc.gather_for_metrics(idx)])  # the real rows only
    assert_same(model, ref, "zero share")


@scenario("metrics")
def _():
    # A padded last batch (as accelerate pads): gather_for_metrics drops the padding wherever it
    # falls (inside a share or at the boundary), and reduce("mean") of per-process means is the
    # mean of the global batch.
    for n in (11, 13, 14):
        acc = HeteroAccelerator(plan=plan(5, 3))
        model, _ = model_pair()
        data = TensorDataset(torch.arange(n), X[:n], Y[:n])
        model, loader = acc.prepare(model, DataLoader(data, batch_size=4))
        got, losses, full = [], [], []
        with torch.no_grad():
            for idx, xb, yb in loader:
                got.append(acc.gather_for_metrics(idx))
                losses.append(acc.reduce(F.mse_loss(model(xb), yb), "mean"))
                everything = acc.gather(idx)
                full.append(F.mse_loss(model.module(X[everything]), Y[everything]))
        assert sorted(torch.cat(got).tolist()) == list(range(n)), (n, got)
        for mine, reference in zip(losses, full):
            assert abs(mine.item() - reference.item()) < 1e-12, (n, mine, reference)
    # Another loader's batch (an evaluation loader, batch 3 per process): the plan's proportions.
    evaluation = acc.prepare(DataLoader(data, batch_size=3))
    idx, _, _ = next(iter(evaluation))
    assert len(idx) == [4, 2][acc.process_index], len(idx)
    assert acc.prepare(evaluation) is evaluation  # preparing twice is harmless, as in accelerate
    # even_batches=False (weighting="none": the user weights the loss): no padding, the last global
    # batch of 14 cut short in the plan's proportions, every sample once, as accelerate keeps it short.
    from accelerate import DataLoaderConfiguration

    acc = HeteroAccelerator(
        plan=plan(5, 3), weighting="none", dataloader_config=DataLoaderConfiguration(even_batches=False)
    )
    short = acc.prepare(DataLoader(TensorDataset(*DATA[:14]), batch_size=4))
    rows = [acc.gather(idx) for idx, _, _ in short]
    assert [len(r) for r in rows] == [8, 6] and torch.cat(rows).tolist() == list(range(14)), rows
    acc.even_batches = True  # the shared state: as the other scenarios expect it


@scenario("epochs")
def _():
    # Two epochs: each covers the data once across processes, in a new order; a resumed epoch
    # (skip_first_batches) continues that epoch's order with the same shares.
    acc = HeteroAccelerator(plan=plan(5, 3))
    loader = acc.prepare(DataLoader(DATA, batch_size=4, shuffle=True))
    orders = []
    for _ in range(2):
        order = torch.cat([acc.gather(idx) for idx, _, _ in loader])
        assert sorted(order.tolist()) == list(range(N)), order
        orders.append(order.tolist())
    assert orders[0] != orders[1], orders
    loader.set_epoch(1)
    resumed = [acc.gather(idx).tolist() for idx, _, _ in acc.skip_first_batches(loader, 1)]
    assert resumed == [orders[1][8:]], (resumed, orders[1])


def assert_solved(plan, batch):
    """``plan`` is the split its own profiles call best: judged by their numbers, not by the wall clock.

    Which rank gets more depends on what each profile measured, and a loaded machine can make
    the emulated quarter-speed device measure as fast as the other; the solver's promise holds
    whatever was measured: every sample placed, none predicted slower than the even split.
    """
    assert sum(plan.sizes) == batch and len(plan.sizes) == 2, plan
    assert plan.step_time <= plan.even_time * (1 + 1e-9), (plan.sizes, plan.times, plan.even_time)


@scenario("profiled")
def _():
    # No plan: each process profiles its own device (cpu and an emulated quarter-speed cpu);
    # both processes hold the plan solved from those profiles.
    acc = HeteroAccelerator(
        devices="cpu,cpu@0.25", loss_fn=F.mse_loss, plan_kwargs={"time_budget": 0.3, "calibrate": 0}
    )
    model, _ = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big = TensorDataset(torch.randn(64, 3, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64))
    model, opt, loader = acc.prepare(model, opt, DataLoader(big, batch_size=16))
    assert_solved(acc.plan, 32)
    sizes = acc.plan.sizes
    both = acc.gather(torch.tensor(sizes))
    assert both.tolist() == sizes * 2, both
    with contextlib.redirect_stdout(io.StringIO()) as said:
        for _ in range(2):  # two passes over the training loader (epochs): the split said once, at the first step
            for xb, _ in loader:
                assert len(xb) == (sizes[acc.process_index] or 2)  # a share of 0 (profiling may give one): two samples
        # The run's end (end_training, which also ends the process group this job goes on with, or the exit).
        acc.report.end()
    lines = [line for line in said.getvalue().splitlines() if line.startswith("hetsplit: HeteroAccelerator:")]
    if acc.process_index == 0:
        assert len(lines) == 2 and f"global batch 32 split rank0:cpu {sizes[0]} " in lines[0], lines
        assert "; predicted step " in lines[0] and "not real hardware): cpu@0.25" in lines[0], lines
        # One timed step a pass (start to start), the first left out as warm-up.
        assert "measured step" in lines[1] and "(median of 1 after 1 warm-up," in lines[1], lines
    else:
        assert not lines, lines


@scenario("prepare_order")
def _():
    # Separate prepare calls, in either order, as accelerate allows: the model prepared first
    # (the loader is planned on it), or the loader first (even shares until the model is
    # prepared, then the profiled plan from the loader's first batch); every step exact.
    data = TensorDataset(X, Y, torch.arange(N))  # (input, target, ...): what the profile reads
    for loader_first in (False, True):
        acc = HeteroAccelerator(
            devices="cpu,cpu@0.25", loss_fn=F.mse_loss, plan_kwargs={"time_budget": 0.3, "calibrate": 0}
        )
        model, ref = model_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if loader_first:
            loader = acc.prepare(DataLoader(data, batch_size=4))
            assert acc.plan.sizes == [4, 4], acc.plan  # provisional: nothing to profile yet
            model, opt = acc.prepare(model, opt)
        else:
            model, opt = acc.prepare(model, opt)
            loader = acc.prepare(DataLoader(data, batch_size=4))
        assert_solved(acc.plan, 8)
        xb, yb, idx = next(iter(loader))
        assert len(idx) == (acc.plan.sizes[acc.process_index] or 2), (len(idx), acc.plan)
        acc.backward(F.mse_loss(model(xb), yb))
        opt.step()
        reference_step(ref, [acc.gather_for_metrics(idx)])
        assert_same(model, ref, f"prepare order, loader first={loader_first}, plan {acc.plan.sizes}")


@scenario("micro_zero")
def _():
    # micro_batches on the process the plan gives 0: its stand-in (two samples) runs once, weighted 0.
    micro = Plan(["rank0", "rank1"], [8, 0], [0.0, 0.0], 8, micro_batches=[[3, 3, 2], []])
    acc = HeteroAccelerator(plan=micro)
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4))
    idx, xb, yb = next(iter(loader))
    seen = []
    for xm, ym in acc.micro_batches(model, (xb, yb)):
        seen.append(len(xm))
        acc.backward(F.mse_loss(model(xm), ym))
    assert seen == [[3, 3, 2], [2]][acc.process_index], seen
    opt.step()
    reference_step(ref, [acc.gather_for_metrics(idx)])
    assert_same(model, ref, "micro-batches with a zero share")


@scenario("rebalance")
def _():
    # rebalance= as in the other integrations: each batch of the training loader is one step of the
    # rebalancer, which may move the shares after any step; every step stays the full-batch step.
    from hetsplit import Rebalancer

    eager = Rebalancer(every=1, threshold=0.0, window=1, max_move=0.125)
    acc = HeteroAccelerator(devices="cpu,cpu@0.5", plan=plan(4, 4), rebalance=eager)
    assert acc.rank_device.name == ["cpu", "cpu@0.5"][acc.process_index], acc.rank_device
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=4, shuffle=True))
    for _ in range(3):
        for idx, xb, yb in loader:
            acc.backward(F.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
            ref.zero_grad()  # reference_step accumulates into what the parameters hold
            reference_step(ref, [acc.gather_for_metrics(idx)])  # a share moved to 0 runs a stand-in: not data
            assert_same(model, ref, f"rebalanced step, plan {acc.plan.sizes}")
    assert acc.rebalancer is not None and acc.rebalancer.steps == 6, acc.rebalancer
    assert acc.plan is acc.rebalancer.plan and sum(acc.plan.sizes) == 8, acc.plan


@scenario("refused")
def _():
    acc = HeteroAccelerator(plan=plan(6, 2))

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    from torch.utils.data import BatchSampler, SequentialSampler, WeightedRandomSampler

    cases = [
        (DataLoader(Stream(), batch_size=2), "map-style dataset"),
        (DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 4, False)), "pass batch_size="),
        (DataLoader(DATA, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, N)), "WeightedRandomSampler"),
    ]
    for loader, fragment in cases:
        try:
            acc.prepare(loader)
        except ValueError as e:
            assert fragment in str(e), (fragment, e)
        else:
            raise AssertionError(f"no error for {fragment}")
    micro = Plan(["rank0", "rank1"], [5, 3], [0.0, 0.0], 8, micro_batches=[[2, 2, 1], [3]])
    for kwargs, fragment in [
        ({"plan": plan_from_sizes(None, ["a", "b", "c"], [1, 1, 2])}, "3 shares"),
        ({"plan": micro, "rebalance": 2}, "HeteroAccelerator(rebalance=2) with a plan with micro-batches"),
        ({"rebalance": -1}, "HeteroAccelerator(rebalance=-1)"),
        ({"weighting": "mean"}, "weighting='mean'"),
        ({"devices": "cpu,cpu,cpu"}, "3 devices"),
    ]:
        try:
            HeteroAccelerator(**kwargs)
        except ValueError as e:
            assert fragment in str(e), (fragment, e)
        else:
            raise AssertionError(f"no error for {kwargs}")


# -- FSDP2 (fsdp_plugin with fsdp_version=2): last, as they turn accelerate's shared state to FSDP --------


def fsdp2_accelerator(**kwargs):
    """A HeteroAccelerator sharding with accelerate's FSDP2 plugin, every Linear its own ``fully_shard``."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # As a new script finds it (the process group kept): no accelerator state, a multi-CPU job.
    AcceleratorState._reset_state()
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=1)
    acc = HeteroAccelerator(fsdp_plugin=plugin, **kwargs)
    assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2, acc.distributed_type
    return acc


def assert_same_sharded(model, ref, what):
    """``assert_same`` for a sharded model: each parameter gathered whole (every process calls it)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.full_tensor().detach() - q.detach()).abs().max().item()
        assert err < 1e-12, f"{what}: parameter {name} differs from the single-process reference by {err}"


@contextlib.contextmanager
def sharded_profiles():
    """The class names of the models the sharded profile times, recorded while inside."""
    from hetsplit.distributed import rank_plan

    calls, original = [], rank_plan.profile_sharded
    rank_plan.profile_sharded = lambda model, *a, **k: calls.append(type(model).__name__) or original(model, *a, **k)
    try:
        yield calls
    finally:
        rank_plan.profile_sharded = original


def big_data():
    return TensorDataset(torch.randn(64, 3, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64))


@scenario("fsdp2_steps")
def _():
    # accelerate's own FSDP2 path on CPU processes (accelerate runs it on GPUs only; HeteroAccelerator
    # sets its state as on GPUs): shares follow the plan, every step of an epoch over a DataLoader with
    # a short last batch equals the full-batch step, for an uneven plan and for a share of 0.
    from hetsplit.distributed.sharded import kind

    for sizes in ((6, 2), (8, 0)):
        acc = fsdp2_accelerator(plan=plan(*sizes))
        model, ref = model_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(*DATA[:14]), batch_size=4, shuffle=True))
        assert kind(model) == "fsdp2" and kind(model[0]) == "fsdp2", type(model)
        seen = []
        for idx, xb, yb in loader:
            own = len(idx)
            acc.backward(F.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
            seen.append(acc.gather_for_metrics(idx))  # every sample once
            ref.zero_grad()
            rows = acc.gather(idx if sizes[acc.process_index] else idx[:0])  # padding in, a share of 0's stand-in out
            reference_step(ref, [rows])
            assert_same_sharded(model, ref, f"FSDP2 plan {sizes}, step {len(seen)}")
        assert own == (sizes[acc.process_index] or 2), (sizes, own)
        assert sorted(torch.cat(seen).tolist()) == list(range(14)), seen


@scenario("fsdp2_micro")
def _():
    # Different micro-batch counts in the plan (3 and 1): every process runs as many forwards (FSDP2's
    # all-gathers are collective), process 1 its 3 samples one at a time; the step stays exact.
    micro = Plan(["rank0", "rank1"], [5, 3], [0.0, 0.0], 8, micro_batches=[[2, 2, 1], [3]])
    acc = fsdp2_accelerator(plan=micro)
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, idx, seen = micro_step(acc, model, opt)
    assert seen == [[2, 2, 1], [1, 1, 1]][acc.process_index], seen
    opt.step()
    reference_step(ref, [acc.gather(idx)])
    assert_same_sharded(model, ref, "FSDP2 micro-batches")
    # accelerate's FSDP2 checkpoint (save_state / load_state) round trip under the uneven plan.
    import tempfile

    folder = tempfile.mkdtemp() if acc.is_main_process else None
    shared = [folder]
    torch.distributed.broadcast_object_list(shared)
    saved = acc.save_state(shared[0])
    before = [p.full_tensor().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(saved)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.full_tensor(), q), "FSDP2 checkpoint round trip"


@scenario("fsdp2_cpu_flag")
def _():
    # cpu=True on a machine with CUDA, no device list: accelerate makes a multi-CPU job and would
    # drop the plugin (each process a DDP copy); HeteroAccelerator shards as it does on GPUs.
    from hetsplit.distributed.sharded import kind

    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        acc = fsdp2_accelerator(cpu=True, plan=plan(6, 2))
    finally:
        torch.cuda.is_available = real
    model, _ = model_pair()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert kind(model) == "fsdp2", type(model)


@scenario("fsdp2_profiled")
def _():
    # No plan, the loader prepared before the model (as the Trainer does): even shares until the
    # model is sharded, then the plan is profiled on the sharded model (no process holds it whole)
    # and the loader follows it from its first batch; the model and loader prepared together too.
    with sharded_profiles() as calls:
        for together in (False, True):
            acc = fsdp2_accelerator(
                devices="cpu,cpu@0.25", loss_fn=F.mse_loss, plan_kwargs={"time_budget": 0.3, "calibrate": 0}
            )
            model, _ = model_pair()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            big = big_data()
            if together:
                model, opt, loader = acc.prepare(model, opt, DataLoader(big, batch_size=16))
            else:
                loader = acc.prepare(DataLoader(big, batch_size=16))
                assert acc.plan.sizes == [16, 16], acc.plan  # provisional: nothing profiled yet
                model, opt = acc.prepare(model, opt)
            assert calls and calls[-1].startswith("FSDP"), calls  # profiled as sharded
            assert_solved(acc.plan, 32)
            both = acc.gather(torch.tensor(acc.plan.sizes))
            assert both.tolist() == acc.plan.sizes * 2, both
            xb, yb = next(iter(loader))
            assert len(xb) == (acc.plan.sizes[acc.process_index] or 2), (len(xb), acc.plan)
            acc.backward(F.mse_loss(model(xb), yb))
            opt.step()


@scenario("fsdp2_model_first")
def _():
    # The model and optimizer prepared first, the loader alone afterwards (accelerate's other usual
    # order): the plan is profiled on the model already sharded, not left at even shares.
    with sharded_profiles() as calls:
        budget = {"time_budget": 0.3, "calibrate": 0}
        acc = fsdp2_accelerator(devices="cpu,cpu@0.25", loss_fn=F.mse_loss, plan_kwargs=budget)
        model, _ = model_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        big = big_data()
        # The model's forwards are throttled since prepare(); the profile throttles whole steps
        # itself, and a second throttle around each forward would slow an emulated GPU's twice.
        depth, deepest = [0], [0]

        @contextlib.contextmanager
        def counted(self, **kwargs):
            depth[0] += 1
            deepest[0] = max(deepest[0], depth[0])
            try:
                with real(self, **kwargs):
                    yield
            finally:
                depth[0] -= 1

        real, Device.throttle = Device.throttle, counted
        try:
            loader = acc.prepare(DataLoader(big, batch_size=16))
        finally:
            Device.throttle = real
        assert calls and calls[-1].startswith("FSDP"), calls  # profiled as sharded, at the loader
        worst = int(acc.gather(torch.tensor([deepest[0]])).max())  # the same verdict on both ranks
        assert worst == 1, f"throttles nested {worst} deep while profiling"
        assert_solved(acc.plan, 32)
        xb, yb = next(iter(loader))
        assert len(xb) == (acc.plan.sizes[acc.process_index] or 2), (len(xb), acc.plan)
        acc.backward(F.mse_loss(model(xb), yb))
        opt.step()


@scenario("fsdp2_placement")
def _():
    # device_placement, one entry per argument as accelerate takes it (FSDP2 ignores it), with the
    # model, optimizer, loader and scheduler in any order: each comes back in its own place.
    acc = fsdp2_accelerator(plan=plan(6, 2))
    model, ref = model_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    args = (DataLoader(DATA, batch_size=4), model, sched, opt)
    loader, model, sched, opt = acc.prepare(*args, device_placement=[True, True, False, True])
    assert isinstance(loader.batch_sampler.plan_at(0), Plan) and type(sched).__name__ == "AcceleratedScheduler", sched
    idx, xb, yb = next(iter(loader))
    assert len(idx) == [6, 2][acc.process_index], len(idx)
    acc.backward(F.mse_loss(model(xb), yb))
    opt.step()
    reference_step(ref, [acc.gather(idx)])
    assert_same_sharded(model, ref, "FSDP2 with device_placement")


torch.distributed.barrier()
torch.distributed.destroy_process_group()
