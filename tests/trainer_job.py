"""The 2-process job behind tests/test_hf_trainer.py: HeteroTrainer against a single-process reference.

A tiny Llama built from a config (float64, nothing downloaded), SYNTHETIC token
sequences of unequal lengths padded per shard (labels -100 on padding), so a loss
weighted by samples instead of tokens would show. Shares run as micro-batches on
emulated memories (``cpu:max2``) in the ``micro*`` scenarios. Prints ``OK <scenario> rank <r>``
per scenario it passes, or its traceback (``tests/integration_launch.py``); first, in the
same launch, the Trainer's and torchrun's patterns of ``tests/integration_jobs.py`` and the
scenarios of ``tests/trainer_eval_job.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os

import torch
import torch.distributed as dist
from integration_launch import TRAINER_PATTERNS, run_patterns, scenario  # tests/ is the script's folder
from trainer_eval_job import arguments  # the Trainer settings every scenario starts from
from trainer_eval_job import run_scenarios as run_eval_scenarios
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from hetsplit.planning import Plan, Profile, plan_from_sizes
from hetsplit.transformers import HeteroTrainer

# HF's causal-LM loss computes in float32 (it casts the logits), so sharded and full-batch
# sums round differently at ~1e-7 relative; a weighting error is of order 1e-2 here.
TOLERANCE = 1e-6
LENGTHS = [3, 9, 5, 12, 7, 4, 10, 6]  # unequal: per-shard padding differs, token counts differ


def sequences(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 50, (LENGTHS[i % len(LENGTHS)],), generator=g)} for i in range(n)]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest in the batch; padding is masked and ignored by the loss (-100).

    Labels are the inputs, or a sample's own ``"labels"`` where it has them.
    """
    longest = max((len(x["input_ids"]) for x in items), default=1)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])] = x["input_ids"]
        mask[i, : len(x["input_ids"])] = 1
        labels[i, : len(x["input_ids"])] = x.get("labels", x["input_ids"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def silent(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sample`` with every label -100 (a prompt without a target): it adds no item to the loss."""
    return {**sample, "labels": torch.full_like(sample["input_ids"], -100)}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def reference_step(model: LlamaForCausalLM, batches: list[list[dict]], lr: float = 0.1) -> None:
    """One SGD step on the given global batches: the model's own loss, averaged over all their label tokens."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tokens = sum(int(collate(b)["labels"][:, 1:].ne(-100).sum()) for b in batches)
    for b in batches:
        model(**collate(b), num_items_in_batch=tokens).loss.backward()  # sum over the batch's tokens / tokens
    opt.step()


def assert_same(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err < TOLERANCE, f"{what}: {name} differs from the single-process reference by {err}"


def train_once(folder, plan, data, devices=None, plan_kwargs=None, **overrides):
    """Train a fresh tiny Llama for one step; ``plan`` is a Plan, a list of shares, or None (profiled)."""
    model = llama()
    ref = copy.deepcopy(model)
    if isinstance(plan, list):
        plan = plan_from_sizes(None, ["rank0", "rank1"], plan)
    trainer = HeteroTrainer(
        model=model, args=arguments(folder, **overrides), train_dataset=data, data_collator=collate, plan=plan,
        devices=devices, plan_kwargs=plan_kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer, model, ref


# A launch less each: tests/integration_jobs.py's Trainer and torchrun patterns first (the first of them checks
# how a job starts), then tests/test_trainer_eval.py's two-process scenarios (GPT-2's eval_loss), before an
# FSDP2 scenario leaves ACCELERATE_USE_FSDP in os.environ.
run_patterns(TRAINER_PATTERNS)
run_eval_scenarios()


@scenario("tokens", folder=True)
def _(folder):
    # The Trainer's own global token normalisation (average_tokens_across_devices, the default)
    # and the rescaled per-process mean (flag off) both equal the full-batch step on 3 + 1 samples.
    data = sequences(4, seed=1)
    for flag in (True, False):
        trainer, model, ref = train_once(folder, [3, 1], data, average_tokens_across_devices=flag)
        assert trainer.plan.sizes == [3, 1]
        reference_step(ref, [data])
        assert_same(model, ref, f"average_tokens_across_devices={flag}")


@scenario("short-last", folder=True)
def _(folder):
    # even_batches=False: the last global batch (2 of 6 samples) is kept short, cut in the plan's
    # proportions, and both steps equal a single process's steps on [0..3] then [4, 5].
    data = sequences(6, seed=17)
    _, model, ref = train_once(
        folder, [3, 1], data, max_steps=2, train_sampling_strategy="sequential",
        accelerator_config={"even_batches": False},
    )  # fmt: skip
    reference_step(ref, [data[:4]])
    ref.zero_grad()
    reference_step(ref, [data[4:]])
    assert_same(model, ref, "a short last global batch, even_batches=False")


@scenario("accumulate", folder=True)
def _(folder):
    # Two global batches accumulated into one step (the Trainer counts the window's tokens).
    data = sequences(8, seed=2)
    _, model, ref = train_once(folder, [1, 3], data, gradient_accumulation_steps=2)
    reference_step(ref, [data])  # the window's token mean, whichever samples fell in which micro-batch
    assert_same(model, ref, "gradient accumulation")


@scenario("zero", folder=True)
def _(folder):
    # A share of 0: one real sample weighted 0, with either normalisation of the Trainer.
    data = sequences(4, seed=3)
    for flag in (True, False):
        trainer, model, ref = train_once(folder, [4, 0], data, average_tokens_across_devices=flag)
        with torch.no_grad():  # the step's loss: the token mean over the global batch, before the step
            loss = ref(**collate(data)).loss.item()
        reference_step(ref, [data])
        assert_same(model, ref, f"zero share, average_tokens_across_devices={flag}")
        # train_loss (nothing logged before the end): the global batch's, on every process (was: 2x, and 0)
        reported = trainer.state.log_history[-1]["train_loss"]
        assert abs(reported - loss) < 1e-5, (reported, loss)


def classify(folder, plan, devices=None):
    """One step of a tiny BERT sequence classifier under ``plan`` equals the full-batch step (float64)."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    model = BertForSequenceClassification(config).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(6)
    data = [{"input_ids": torch.randint(1, 50, (6,), generator=g), "labels": torch.tensor(i % 3)} for i in range(8)]
    trainer = HeteroTrainer(
        model=model, args=arguments(folder, per_device_train_batch_size=4), train_dataset=data, plan=plan,
        devices=devices,
    )  # fmt: skip
    trainer.train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    ref(**batch).loss.backward()
    opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err < 1e-12, f"sequence classification: {name} differs by {err}"  # float64 end to end


@scenario("classify", folder=True)
def _(folder):
    # BERT sequence classification computes its own mean over samples and ignores
    # num_items_in_batch: the step must still be the full-batch step on 6 + 2 samples.
    classify(folder, plan_from_sizes(None, ["rank0", "rank1"], [6, 2]))


@scenario("evaluate", folder=True)
def _(folder):
    # Evaluation first (no plan: each process profiles on the evaluation loader), 9 samples in
    # global batches of 4: the last batch is padded. eval_loss is the plain one-process Trainer's
    # (each batch's token mean, weighted by samples), and compute_metrics sees each sample once.
    data = sequences(9, seed=4)
    seen = []

    def metrics(prediction):
        seen.append(len(prediction.label_ids))
        return {}

    model = llama()
    trainer = HeteroTrainer(
        model=model, args=arguments(folder), eval_dataset=data, data_collator=collate, compute_metrics=metrics,
        devices="cpu,cpu@0.25", plan_kwargs={"time_budget": 0.3, "calibrate": 0},
    )  # fmt: skip
    loss = trainer.evaluate()["eval_loss"]
    with torch.no_grad():
        expected = sum(len(b) * model(**collate(b)).loss.item() for b in (data[:4], data[4:8], data[8:])) / 9
    assert abs(loss - expected) < TOLERANCE, (loss, expected)
    assert seen == [9], seen


@scenario("profiled", folder=True)
def _(folder):
    # No plan: each process profiles the model on its device; both follow the plan solved from the profiles.
    data = sequences(16, seed=5)
    model = llama()
    trainer = HeteroTrainer(
        model=model, args=arguments(folder, per_device_train_batch_size=8), train_dataset=data,
        data_collator=collate, devices="cpu,cpu@0.25", plan_kwargs={"time_budget": 0.3, "calibrate": 0},
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as said:
        trainer.train()
    # Process 0 says the split it chose and its predicted step, then the measured step; process 1 nothing.
    lines = [line for line in said.getvalue().splitlines() if line.startswith("hetsplit: HeteroTrainer:")]
    if dist.get_rank() == 0:
        assert len(lines) == 2 and "global batch 16 split rank0:cpu" in lines[0], lines
        assert "; predicted step " in lines[0] and "not real hardware): cpu@0.25" in lines[0], lines
        assert "measured step" in lines[1], lines
    else:
        assert not lines, lines
    # The plan its own profiles call best (which rank gets more is what they measured: a loaded
    # machine can make the emulated quarter-speed CPU measure as fast as the other), the same on both.
    plan = trainer.plan
    assert sum(plan.sizes) == 16 and plan.step_time <= plan.even_time * (1 + 1e-9), (plan.sizes, plan.times)
    theirs = [None, None]
    dist.all_gather_object(theirs, list(plan.sizes))
    assert theirs == [list(plan.sizes)] * 2, theirs


@scenario("rebalance", folder=True)
def _(folder):
    # rebalance= as in the other integrations: each training_step is one step of the rebalancer (the
    # Trainer fetches a whole accumulation window first); the step is still the full-batch step.
    from hetsplit import Rebalancer

    data = sequences(4, seed=14)
    eager = Rebalancer(every=1, threshold=0.0, window=1)
    model = llama()
    ref = copy.deepcopy(model)
    trainer = HeteroTrainer(
        model=model, args=arguments(folder), train_dataset=data, data_collator=collate,
        plan=plan_from_sizes(None, ["rank0", "rank1"], [3, 1]), devices=["cpu", "cpu@1"], rebalance=eager,
    )  # fmt: skip
    trainer.train()
    rebalancer = trainer.accelerator.rebalancer
    assert rebalancer is not None and rebalancer.steps == 1 and trainer.plan is rebalancer.plan, rebalancer
    assert trainer.rank_device.name == ["cpu", "cpu@1"][dist.get_rank()], trainer.rank_device
    reference_step(ref, [data])
    assert_same(model, ref, "a rebalanced Trainer step")


# Micro-batches: rank 0's emulated memory holds 2 samples, so its share of 6 runs as 2 + 2 + 2
# (a forward on more would raise torch.OutOfMemoryError); every step is still the full-batch step.
MICRO = Plan(["rank0", "rank1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
CAPPED = "cpu:max2,cpu"


@scenario("micro", folder=True)
def _(folder):
    # Each micro-batch's loss is weighted by its own label tokens, under either normalisation of the Trainer.
    data = sequences(8, seed=7)
    for flag in (True, False):
        trainer, model, ref = train_once(
            folder, MICRO, data, CAPPED, per_device_train_batch_size=4, average_tokens_across_devices=flag
        )
        assert trainer.plan.micro_batches == [[2, 2, 2], [2]]
        reference_step(ref, [data])
        assert_same(model, ref, f"micro-batches, average_tokens_across_devices={flag}")
    # A step of its own after training (outside any window): its items are counted then, once,
    # though rank 0 runs several micro-batches and rank 1 one; not the last window's count. Rank 0's
    # first micro-batch has no label token (sequences of one token): it is not run and adds nothing.
    other = [{"input_ids": torch.tensor([5])}, {"input_ids": torch.tensor([7])}, *sequences(16, seed=11)[2::2]]
    model.zero_grad()
    loss = trainer.training_step(trainer.model_wrapped, collate(other[:6] if dist.get_rank() == 0 else other[6:]))
    assert torch.isfinite(loss), loss
    check = copy.deepcopy(model)
    check.zero_grad()
    check(**collate(other), num_items_in_batch=int(collate(other)["labels"][:, 1:].ne(-100).sum())).loss.backward()
    for (name, p), q in zip(model.named_parameters(), check.parameters()):
        err = (p.grad - q.grad).abs().max().item()
        assert err < TOLERANCE, f"a step outside the loop: {name}'s gradient differs by {err}"


@scenario("micro-accumulate", folder=True)
def _(folder):
    # The Trainer's gradient accumulation over micro-batched shares: the window's tokens counted once.
    data = sequences(16, seed=8)
    _, model, ref = train_once(
        folder, MICRO, data, CAPPED, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    reference_step(ref, [data])
    assert_same(model, ref, "micro-batches with gradient accumulation")


@scenario("micro-classify", folder=True)
def _(folder):
    # Sequence classification (a mean over samples) with micro-batches: still float64-exact.
    classify(folder, MICRO, CAPPED)


def masked_mean(outputs, labels, num_items_in_batch=None):
    """A custom loss as many write it: ``(l * mask).sum() / mask.sum()``, 0/0 = NaN over no label tokens.

    The mask alone hides -100 (no ``ignore_index``, which would write exact zeros into the
    backward), so a weight of 0 backpropagates 0 * (1/0) = NaN into every parameter.
    """
    target = labels[:, 1:]
    mask = target.ne(-100)
    logits = outputs.logits[:, :-1].transpose(1, 2)
    losses = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
    return (losses * mask).sum() / mask.sum()  # float64 throughout (the model's own loss casts to float32)


def masked_reference_step(ref, data, lr=0.1):
    """One SGD step of the plain model on the global batch ``data`` under :func:`masked_mean`."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    inputs = collate(data)
    masked_mean(ref(**{k: v for k, v in inputs.items() if k != "labels"}), inputs["labels"]).backward()
    opt.step()


def assert_exact(got, want, what):
    for (name, p), q in zip(got, want):
        assert torch.isfinite(p).all(), f"{what}: {name} is not finite"
        err = (p - q).abs().max().item()
        assert err < 1e-12, f"{what}: {name} differs from the float64 full-batch reference by {err}"


@scenario("micro-masked", folder=True)
def _(folder):
    # Weighted 0, a masked mean over no tokens is 0 in value but NaN in its backward (0 * 1/0) in every
    # parameter. In order (sequential): rank 0's share of 6 runs as 2 + 2 + 2 and its first micro-batch's
    # labels are all -100; rank 1's 2 samples have none at all. The step is the full-batch step, finite.
    data = [silent(d) if i in (0, 1, 6, 7) else d for i, d in enumerate(sequences(8, seed=12))]
    model = llama()
    ref = copy.deepcopy(model)
    trainer = HeteroTrainer(
        model=model, args=arguments(folder, per_device_train_batch_size=4, train_sampling_strategy="sequential"),
        train_dataset=data, data_collator=collate, plan=MICRO, devices=CAPPED, compute_loss_func=masked_mean,
    )  # fmt: skip
    trainer.train()
    masked_reference_step(ref, data)
    assert_exact(model.named_parameters(), ref.parameters(), "a masked-mean loss with label-less micro-batches")
    # A step of its own: now rank 0's last micro-batch has no labels (the one run last has), and rank 1's
    # share is empty, so it runs one real sample weighted 0: the data set's first, which has no labels.
    other = [silent(d) if i >= 4 else d for i, d in enumerate(sequences(6, seed=13))]
    model.zero_grad()
    loss = trainer.training_step(trainer.model_wrapped, collate(other if dist.get_rank() == 0 else []))
    assert torch.isfinite(loss), loss
    check = copy.deepcopy(model)
    check.zero_grad()
    inputs = collate(other)
    masked_mean(check(**{k: v for k, v in inputs.items() if k != "labels"}), inputs["labels"]).backward()
    grads = [(name, p.grad) for name, p in model.named_parameters()]
    assert_exact(grads, [p.grad for p in check.parameters()], "a step of its own with label-less micro-batches")


@scenario("micro-memory", folder=True)
def _(folder):
    # Whole shares of 4 over emulated memories of 2 and 3 samples: the forward raises, as a GPU's would.
    # Both shares are too large, so both ranks stop at the same point (no collective left waiting).
    try:
        train_once(folder, [4, 4], sequences(8, seed=9), "cpu:max2,cpu:max3", per_device_train_batch_size=4)
    except torch.OutOfMemoryError as e:
        assert "a forward on 4 samples" in str(e), e
    else:
        raise AssertionError("a share over the emulated memory trained without torch.OutOfMemoryError")


@scenario("micro-solved", folder=True)
def _(folder):
    # Solved with accumulate (plan_kwargs) for devices whose memories hold 2 and 3 samples, from
    # given profiles (no timing): 8 samples fit only as micro-batches, which the Trainer follows
    # within each cap, and the step is the full-batch step.
    rank = int(os.environ["RANK"])  # the Trainer starts the process group
    device = ["cpu:max2", "cpu:max3"][rank]
    profile = Profile.from_measurements({device: [(1, 0.010), (2 + rank, 0.018 + 0.008 * rank)]}, {device: 2 + rank})
    data = sequences(8, seed=10)
    model = llama()
    ref = copy.deepcopy(model)
    trainer = HeteroTrainer(
        model=model, args=arguments(folder, per_device_train_batch_size=4), train_dataset=data,
        data_collator=collate, devices="cpu:max2,cpu:max3", profile=profile,
        plan_kwargs={"accumulate": True, "calibrate": 0},
    )  # fmt: skip
    trainer.train()
    micro = trainer.plan.micro_batches
    assert max(micro[0]) <= 2 and max(micro[1]) <= 3 and any(len(m) > 1 for m in micro), micro
    reference_step(ref, [data])
    assert_same(model, ref, f"solved micro-batches {micro}")
    if rank == 0:
        print(f"solved micro-batches {micro}", flush=True)


# -- FSDP2 (the Trainer's fsdp settings): last, as they turn accelerate's shared state to FSDP ---------

FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


def assert_same_sharded(model, ref, what):
    """``assert_same`` for a model FSDP2 sharded: each parameter gathered whole (every process calls it)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.full_tensor().detach() - q.detach()).abs().max().item()
        assert err < TOLERANCE, f"{what}: {name} differs from the single-process reference by {err}"


@scenario("fsdp2", folder=True)
def _(folder):
    # The Trainer's own FSDP2 settings (fsdp_config version 2, a fully_shard per decoder layer), on
    # CPU processes as on GPUs: an uneven plan, a share of 0, and two accumulated global batches all
    # equal the full-batch step on token-weighted losses.
    from hetsplit.distributed.sharded import kind

    for sizes, steps in (([3, 1], 1), ([4, 0], 1), ([1, 3], 2)):
        data = sequences(4 * steps, seed=11)
        trainer, model, ref = train_once(folder, sizes, data, gradient_accumulation_steps=steps, **FSDP2)
        assert trainer.is_fsdp_enabled and kind(trainer.model) == "fsdp2", type(trainer.model)
        assert kind(trainer.model.model.layers[0]) == "fsdp2", "each decoder layer its own fully_shard"
        reference_step(ref, [data])
        assert_same_sharded(trainer.model, ref, f"FSDP2, plan {sizes}, {steps} accumulated")
    # A process without label tokens (in order: rank 1's one sample; then the two a share of 0 runs,
    # the data set's first) still takes part in FSDP2's collectives, adding exact zeros: under a
    # masked mean, whose backward over no tokens is NaN (0 * 1/0) in every parameter.
    for sizes, silenced in (([3, 1], (3,)), ([4, 0], (0, 1))):
        data = [silent(d) if i in silenced else d for i, d in enumerate(sequences(4, seed=14))]
        model = llama()
        ref = copy.deepcopy(model)
        trainer = HeteroTrainer(
            model=model, args=arguments(folder, train_sampling_strategy="sequential", **FSDP2), train_dataset=data,
            data_collator=collate, plan=plan_from_sizes(None, ["rank0", "rank1"], sizes), compute_loss_func=masked_mean,
        )  # fmt: skip
        trainer.train()
        masked_reference_step(ref, data)
        whole = [(name, p.full_tensor().detach()) for name, p in trainer.model.named_parameters()]
        assert_exact(whole, ref.parameters(), f"FSDP2, plan {sizes}, samples {silenced} without labels")


@scenario("fsdp2-save", folder=True)
def _(folder):
    # A tied GPT-2 saved by HeteroTrainer under FSDP2 holds the keys the plain Trainer's save holds:
    # the tied lm_head.weight once, as transformers' save_pretrained drops it (was: saved twice).
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    sharded = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    keys = []
    for cls, kwargs in ((Trainer, {}), (HeteroTrainer, {"plan": plan_from_sizes(None, ["rank0", "rank1"], [3, 1])})):
        out = os.path.join(folder, cls.__name__)
        args = arguments(out, **(sharded if cls is HeteroTrainer else {}))
        trainer = cls(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=sequences(4, seed=1),
            data_collator=collate,
            **kwargs,
        )
        trainer.train()
        trainer.save_model(out)
        if int(os.environ["RANK"]) != 0:
            continue  # each process has its own folder: process 0 saves
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as saved:
            keys.append(sorted(saved.keys()))
    if not keys:
        return
    assert keys[1] == keys[0], f"HeteroTrainer saved {sorted(set(keys[1]) ^ set(keys[0]))} unlike the plain Trainer"
    assert "lm_head.weight" not in keys[0], keys[0]


@scenario("fsdp2-profiled", folder=True)
def _(folder):
    # No plan: the Trainer prepares its loader before the model, so the shares stay even until
    # accelerate has sharded the model, then each process profiles it sharded (nothing holds it
    # whole) and the loader follows the solved plan from its first batch; the step stays exact.
    from hetsplit.distributed import rank_plan

    calls, original = [], rank_plan.profile_sharded
    rank_plan.profile_sharded = lambda model, *a, **k: calls.append(type(model).__name__) or original(model, *a, **k)
    try:
        data = sequences(16, seed=12)
        trainer, _, ref = train_once(
            folder, None, data, devices="cpu,cpu@0.25", plan_kwargs={"time_budget": 0.3, "calibrate": 0},
            per_device_train_batch_size=8, **FSDP2,
        )  # fmt: skip
    finally:
        rank_plan.profile_sharded = original
    assert calls and calls[0].startswith("FSDP"), calls  # profiled as sharded
    plan = trainer.plan
    assert sum(plan.sizes) == 16 and plan.step_time <= plan.even_time * (1 + 1e-9), (plan.sizes, plan.times)
    reference_step(ref, [data])
    assert_same_sharded(trainer.model, ref, f"FSDP2, profiled plan {plan.sizes}")
    # Evaluation of the sharded model, 9 samples in global batches of 4 cut in the plan's
    # proportions: eval_loss is the plain one-process Trainer's (each batch's token mean, by samples).
    held_out = sequences(9, seed=15)
    loss = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
    with torch.no_grad():
        expected = sum(len(b) * ref(**collate(b)).loss.item() for b in (held_out[:4], held_out[4:8], held_out[8:])) / 9
    assert abs(loss - expected) < TOLERANCE, (loss, expected)


@scenario("fsdp2-micro", folder=True)
def _(folder):
    # Micro-batches under FSDP2: every process runs as many forwards (the plan's largest count;
    # its collectives would hang otherwise), a smaller share in more, smaller pieces, a piece
    # without label tokens adding exact zeros under a masked mean; a given plan with 3 and 1,
    # and one solved (plan_kwargs accumulate) for memories of 2 and 3 samples: both exact.
    rank = int(os.environ["RANK"])
    given = Plan(["rank0", "rank1"], [6, 2], [0.0, 0.0], 8, micro_batches=[[2, 2, 2], [2]])
    device = ["cpu:max2", "cpu:max3"][rank]
    profile = Profile.from_measurements({device: [(1, 0.010), (2 + rank, 0.018 + 0.008 * rank)]}, {device: 2 + rank})
    solved = {"devices": "cpu:max2,cpu:max3", "profile": profile, "plan_kwargs": {"accumulate": True, "calibrate": 0}}
    for what, kwargs in (("given", {"plan": given, "devices": CAPPED}), ("solved", solved)):
        data = [silent(d) if i in (0, 1) else d for i, d in enumerate(sequences(8, seed=16))]  # a piece without labels
        model = llama()
        ref = copy.deepcopy(model)
        args = arguments(folder, per_device_train_batch_size=4, train_sampling_strategy="sequential", **FSDP2)
        trainer = HeteroTrainer(
            model=model, args=args, train_dataset=data, data_collator=collate, compute_loss_func=masked_mean, **kwargs
        )
        trainer.train()
        micro = trainer.plan.micro_batches
        assert any(len(m) > 1 for m in micro), micro
        masked_reference_step(ref, data)
        whole = [(name, p.full_tensor().detach()) for name, p in trainer.model.named_parameters()]
        assert_exact(whole, ref.parameters(), f"FSDP2 micro-batches ({what}) {micro}")


dist.barrier()
dist.destroy_process_group()
