"""The Hugging Face Trainer on unequal devices: HeteroTrainer gives each process its share of every batch.

  hetsplit launch --devices cpu,cpu@0.25 examples/hf_trainer_hetero.py      # CPU + an emulated 1/4-speed CPU
  hetsplit launch --devices cuda:0,cuda:1 examples/hf_trainer_hetero.py     # two unequal GPUs, same script
  accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_hetero.py --devices cpu,cpu@0.25

The only change from a plain Trainer script is the class:

  trainer = Trainer(model=model, args=args, train_dataset=train, ...)
  trainer = HeteroTrainer(model=model, args=args, train_dataset=train, ...)

A tiny Llama built from a config (nothing downloaded) learns SYNTHETIC token sequences
of unequal lengths (a repeating pattern per sequence, padded per batch with labels
-100). The global batch is the Trainer's (processes × per_device_train_batch_size);
each process profiles the model on its device and gets its share; the loss is weighted
by label tokens, so every step equals a step on the whole global batch.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from hetsplit.transformers import HeteroTrainer


def synthetic_text(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """SYNTHETIC sequences: each repeats a random 3-token motif for 6 to 24 tokens (learnable, no download)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, 64, (3,), generator=g)
        length = int(torch.randint(6, 25, (1,), generator=g))
        out.append({"input_ids": motif.repeat(9)[:length]})
    return out


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest sequence; padding is masked and ignored by the loss (-100)."""
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])], mask[i, : len(x["input_ids"])] = x["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None, help="one device per process (default: $HETSPLIT_DEVICES)")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size, as for Trainer")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds each process profiles")
    parser.add_argument("--output-dir", default="hf_trainer_hetero_out")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=32,
        max_steps=args.steps, learning_rate=3e-3, logging_steps=max(args.steps // 4, 1), eval_strategy="steps",
        eval_steps=max(args.steps // 2, 1), save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = HeteroTrainer(
        model=model, args=training, train_dataset=synthetic_text(args.train_size, 1),
        eval_dataset=synthetic_text(256, 2), data_collator=collate, devices=args.devices,
        plan_kwargs={"time_budget": args.budget},
    )  # fmt: skip
    if trainer.is_world_process_zero():
        print("data: SYNTHETIC token sequences (repeating motifs, unequal lengths; no download)", flush=True)
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        plan = trainer.plan
        print("plan:", ", ".join(f"{d} {s}" for d, s in zip(plan.devices, plan.sizes)), f"of {plan.batch_size}")
        print(f"eval loss {metrics['eval_loss']:.3f} after {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
