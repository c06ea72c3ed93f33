"""FSDP2 across unequal ranks: a tiny Llama sharded with fully_shard, each rank's share and micro-batches from one plan.

Launch one process per device:

  hetsplit launch --devices cpu,cpu@0.25:max8 examples/fsdp_hetero.py       # CPU-only: the second rank emulated,
                                                                           # a quarter of the speed, 8 samples at once
  hetsplit launch --devices cuda:0,cuda:1 examples/fsdp_hetero.py          # two unequal GPUs (NCCL)
  torchrun --nproc_per_node=2 examples/fsdp_hetero.py --devices cpu,cpu@0.25:max8

The model (a Llama built from a small LlamaConfig: random weights, nothing downloaded)
is sharded per decoder layer and at the root, so no rank holds all of it. Each rank
profiles its device, the ranks agree on a plan (shares, and micro-batches where a
device's memory cap needs them), and every step is the full-batch step: each rank's
gradient weighted by its share. Data: SYNTHETIC token sequences (a repeating pattern
plus noise, labelled so). --save DIR writes a sharded checkpoint (torch.distributed.checkpoint)
at the end; --resume DIR loads one first, whatever plan or world size wrote it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import run_rank

import hetsplit.distributed as hd

ENV_DEVICES = "HETSPLIT_DEVICES"  # what 'hetsplit launch --devices' sets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        default=os.environ.get(ENV_DEVICES) or "cpu,cpu@0.25:max8",
        help="one device per rank (default: what 'hetsplit launch --devices' set, else cpu,cpu@0.25:max8)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences) per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds each rank profiles")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a dead or hung rank is an error")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0: torch's choice)")
    parser.add_argument("--save", metavar="DIR", help="write a sharded checkpoint (DCP) here at the end")
    parser.add_argument("--resume", metavar="DIR", help="load a sharded checkpoint (DCP) from here first")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    return parser.parse_args()


class SyntheticTokens(Dataset):
    """SYNTHETIC sequences: each a random shift of one fixed token pattern, with a tenth of the tokens noise."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        pattern = torch.randint(0, vocab, (seq_len * 2,), generator=gen)
        shifts = torch.randint(0, seq_len, (n,), generator=gen)
        self.tokens = torch.stack([pattern[s : s + seq_len] for s in shifts.tolist()])
        noise = torch.rand(self.tokens.shape, generator=gen) < 0.1
        self.tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}  # the model shifts the labels itself


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A tiny Llama from a config (random weights, the same on every rank: seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def train(args: argparse.Namespace) -> None:
    try:
        with hd.guard(what="joining the process group"):
            dev = hd.init(args.timeout, devices=args.devices)
    except ValueError as e:
        raise ValueError(f"--devices {args.devices}: {e}") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    devices = args.devices.split(",")
    say(f"{world} ranks on {', '.join(devices)} ({dist.get_backend()})")
    if any("@" in d or ":max" in d for d in devices):
        say("emulated devices are real devices slowed down by sleeping (@speed) or given a small memory (:maxN); "
            "not real hardware")  # fmt: skip

    model = build_model(args, dev.torch_device)
    data = SyntheticTokens(args.batch_size * 8, args.seq_len, model.config.vocab_size)
    say(f"data: SYNTHETIC token sequences ({len(data)} of {args.seq_len} tokens; no download)")
    # One shard group of every rank (a 1-D mesh): each decoder layer is gathered only while it runs.
    mesh = init_device_mesh(dev.torch_device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = sum(p.numel() for p in model.parameters())
    say(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {params:,} parameters, sharded over {world} ranks")

    # The ranks profile the sharded model in turns (no rank holds it whole), the plan gives
    # each a share, and a share beyond a device's memory cap runs as micro-batches.
    sample = data[:8]
    plan = hd.plan(
        model, sample, args.batch_size, device=dev, loss_fn=lambda out: out.loss, accumulate=True,
        time_budget=args.budget,
    )  # fmt: skip
    say("plan:", ", ".join(f"{d} {s} as {m}" for d, s, m in zip(plan.devices, plan.sizes, plan.micro_batches)))
    hd.weight_gradients(model, plan)  # each rank's gradient by its share: the full-batch gradient
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.resume:
        msd, osd = get_state_dict(model, opt)  # this rank's shards, in the checkpoint's keys
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=args.resume)  # any plan, any world size wrote it
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        say(f"resumed from {args.resume}")
    loader = hd.data_loader(data, plan, shuffle=True, seed=0)

    done, start = 0, time.perf_counter()
    while done < args.steps:
        loader.batch_sampler.set_epoch(done)
        for batch in loader:
            batch = {k: v.to(dev.torch_device) for k, v in batch.items()}
            with hd.guard(step=done):
                opt.zero_grad(set_to_none=True)
                # Every rank runs as many micro-batches as the plan's largest count (FSDP2
                # gathers and reduce-scatters in each), so ranks never wait on each other forever.
                for micro in hd.micro_batches(model, batch, plan, device=dev):
                    with dev.throttle():
                        loss = model(**micro).loss  # a mean per micro-batch; the weighting does the rest
                        loss.backward()
                opt.step()
            if done % 5 == 0 or done == args.steps - 1:
                say(f"step {done}: loss {loss.item():.3f} (rank 0's last micro-batch)")
            done += 1
            if done >= args.steps:
                break
    seconds = time.perf_counter() - start
    say(f"{done} steps in {seconds:.2f} s ({seconds / max(done, 1) * 1e3:.1f} ms/step)")
    if args.save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.save)  # each rank writes its shards
        say(f"saved a sharded checkpoint to {args.save}")
    dev.set_speed(None)
    with hd.guard(what="finishing"):
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    run_rank(train, args, "fsdp_hetero.py")


if __name__ == "__main__":
    main()
