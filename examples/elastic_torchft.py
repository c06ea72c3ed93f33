"""Elastic heterogeneous training on torchft: devices join and leave, the global batch and the gradient stay exact.

Start a lighthouse, then one process per device (any may stop and start again at any time):

  torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000 &
  python examples/elastic_torchft.py --devices cpu,cpu@0.25 --group 0 &
  python examples/elastic_torchft.py --devices cpu,cpu@0.25 --group 1 &

A node's ranks can be one group (`+` joins them; the model replicated on them):

  torchrun --nproc-per-node 2 examples/elastic_torchft.py --devices cpu+cpu@0.5,cpu@0.25 --group 0 &

Each group takes its share of every global batch, solved from the stored profile for the
groups present (no profile: measured on its first steps); a joiner is healed from a peer.
Data: SYNTHETIC (random tensors, labelled so; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetsplit.devices import parse_device
from hetsplit.distributed.elastic import ElasticGroup
from hetsplit.planning.profile import latest_profile
from hetsplit.profiler import fingerprint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", default="cpu,cpu@0.25", help="per possible group, its ranks' devices joined by +")
parser.add_argument("--group", type=int, default=0, help="this group's index in --devices")
parser.add_argument("--lighthouse", default="http://localhost:29510")
parser.add_argument("--batch-size", type=int, default=256, help="the global batch, whoever is present")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--checkpoint", default=None, help="a file saved every 20 steps and resumed from")
args = parser.parse_args()

torch.manual_seed(0)  # the same model and data in every group
dataset = TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))  # SYNTHETIC
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
devices = [g.split("+") for g in args.devices.split(",")]
if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # this group's ranks, under torchrun
    dist.init_process_group("gloo")
dev = parse_device(devices[args.group][dist.get_rank() if dist.is_initialized() else 0])
group = ElasticGroup(
    model,
    opt,
    batch_size=args.batch_size,
    devices=devices,
    group=args.group,
    lighthouse=args.lighthouse,
    profile=latest_profile([d for g in devices for d in g], model=fingerprint(model)),
    checkpoint=args.checkpoint,
)
while group.step < args.steps:
    step = group.begin()  # the quorum; this group's share of global batch `step`
    x, y = group.local_batch(dataset[group.global_indices(len(dataset))])
    with dev.throttle():  # an emulated device (cpu@0.25) works at its speed
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    if group.commit() and args.checkpoint and step % 20 == 19:  # a discarded step is run again
        group.save()
    if step % 20 == 0:
        print(
            f"group {args.group} step {step}: loss {loss.item():.3f}, groups {group.members}, shares {group.plan.sizes}"
        )
group.shutdown()
