"""nanoGPT's train.py on unequal ranks: its shape, with the five lines hetsplit changes marked `# hetsplit`.

  hetsplit launch --devices cpu,cpu@0.5 examples/nanogpt_hetero.py        # a CPU-only machine
  hetsplit launch --devices cuda:0,cuda:1 examples/nanogpt_hetero.py --dtype=float32
  python examples/nanogpt_hetero.py --batch_size=16 --gradient_accumulation_steps=2   # one process

Every rank draws the same global micro-batch from a random stream of its own
(hd.shared_batch) and trains on its planned share of it; the gradients are weighted by
the shares, so the run trains as one process does on the whole batch (the third line
above is that process for a two-rank run's defaults; tests/test_nanogpt_example.py
compares them). Rank 0 alone evaluates, drawing from torch's generator, as nanoGPT does:
the training batches do not drift.

The model is nanoGPT's GPT (model.py), shrunk; the data are SYNTHETIC token ids (a fixed
random sequence, nothing downloaded). Float64 by default, so a run on several ranks equals
one process to round-off. nanoGPT's configurator: ``--key=value`` sets a global below.
Besides the five lines, ``hd.init()`` and ``dev.throttle()`` make an emulated device
(``cpu@0.5``) slow; on real devices nanoGPT's own ``init_process_group`` serves.
"""

from __future__ import annotations

import ast
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetsplit.distributed as hd  # hetsplit (1/5)

# -- config (nanoGPT's names; tiny) ----------------------------------------------------------
out_file = ""  # where rank 0 saves the trained parameters (torch.save), if set
plan_weights = None  # e.g. [3,1]: shares set by hand instead of profiled (a split that does not move)
eval_interval = 3
eval_iters = 2
batch_size = 8  # micro-batch per rank, as in nanoGPT; hetsplit makes it the global micro-batch x ranks
block_size = 16
gradient_accumulation_steps = 4  # across all ranks, as in nanoGPT
n_layer, n_head, n_embd, vocab_size, dropout, bias = 2, 2, 32, 64, 0.0, False
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 1e-3, 6, 1e-1, 0.9, 0.95, 1.0
dtype = "float64"  # float32 for speed; float64 compares with one process to round-off
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        sys.exit(f"unknown config key {key!r}; the keys are the globals of {__file__}")
    try:
        globals()[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        globals()[key] = value

# -- the model: nanoGPT's model.py, shortened ------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd, bias=bias), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, 0.0, std) if p.dim() > 1 else None

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))
        return logits, loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2))


# -- train.py ---------------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
dev = hd.init(timeout=120) if ddp else None  # nanoGPT: init_process_group(backend); here for emulated devices
throttle = dev.throttle if dev is not None else nullcontext
if ddp:
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, master_process, seed_offset = dev.torch_device, ddp_rank == 0, ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    device, master_process, seed_offset, ddp_world_size = torch.device("cpu"), True, 0, 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
batch_size *= ddp_world_size  # hetsplit (2/5): every rank draws the global micro-batch and trains on its share
torch.manual_seed(1337 + seed_offset)
torch.set_default_dtype(getattr(torch, dtype))

# SYNTHETIC data (labelled so): a fixed random token sequence, the same in every process.
data = torch.randint(vocab_size, (4096,), generator=torch.Generator().manual_seed(0))
splits = {"train": data[:3584], "val": data[3584:]}
if master_process:
    print(f"data: SYNTHETIC token ids ({len(data)}, vocabulary {vocab_size}); model: GPT in {dtype}")


def get_batch(split):
    d = splits[split]
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


model = GPT().to(device)
optimizer = model.configure_optimizers()
if ddp:
    model = DDP(model)
plan = hd.plan(model, get_batch("train"), batch_size, device=dev, weights=plan_weights) if ddp else None  # (3/5)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)  # torch's own generator, on rank 0 alone: no longer a drift
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


X, Y = hd.shared_batch(get_batch, "train", plan=plan)  # hetsplit (4/5)
raw_model = model.module if ddp else model
iter_num, t0 = 0, time.time()
while iter_num < max_iters:
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with throttle():
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = hd.shared_batch(get_batch, "train", plan=plan)  # hetsplit (5/5)
        with throttle():
            loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1

if master_process and out_file:
    torch.save({k: v.detach().cpu() for k, v in raw_model.state_dict().items()}, out_file)
    print(f"saved the parameters to {out_file}")
