"""The course's hand-written multi-device LeNet loop, with a balanced split and shard-weighted gradients.

Each device gets its own copy of the parameters, made with Device.copy (never the
course's p.to(device): on cpu + cpu@0.25, one torch device, it hands both "devices" the
same tensor and every SGD update is applied twice); every batch is cut by the sizes
solved from a profile of the devices (hetsplit.parallel.scatter) instead of an even split; each
device computes the loss of its own shard; hetsplit.reduce_gradients sums the gradients,
weighted by shard size, onto every device; each device takes the same SGD step.

Run: python examples/lenet_from_scratch.py --devices cpu,cpu@0.25 [--data synthetic] [--epochs 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import accuracy, add_data_args, load

import hetsplit


def init_params(seed: int = 0) -> list[torch.Tensor]:
    """LeNet's weights as plain tensors, as the course builds them."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    return [
        w(6, 1, 5, 5),
        torch.zeros(6),
        w(16, 6, 5, 5),
        torch.zeros(16),
        w(16 * 5 * 5, 120),
        torch.zeros(120),
        w(120, 84),
        torch.zeros(84),
        w(84, 10),
        torch.zeros(10),
    ]


def lenet(x: torch.Tensor, p: list[torch.Tensor]) -> torch.Tensor:
    h = F.avg_pool2d(F.relu(F.conv2d(x, p[0], p[1], padding=2)), 2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, p[2], p[3])), 2).flatten(1)
    h = F.relu(h @ p[4] + p[5])
    h = F.relu(h @ p[6] + p[7])
    return h @ p[8] + p[9]


def copy_params(params: list[torch.Tensor], device) -> list[torch.Tensor]:  # device: from hetsplit.parse_devices
    """The course's get_params: a gradient-tracking copy of every parameter on ``device``.

    Not ``p.to(device)``: ``"cpu@0.25"`` is no torch device string (torch says "Invalid
    device string"), and ``p.to(device.torch_device)`` returns ``p`` itself when it is
    already there, so ``cpu`` and ``cpu@0.25`` would share one tensor and every SGD
    update would be applied to it twice. ``Device.copy`` always copies.
    """
    return device.copy(params, requires_grad=True)


def train_batch(x, y, device_params, devices, sizes, lr) -> float:
    xs = hetsplit.parallel.scatter(x, devices, sizes)
    ys = hetsplit.parallel.scatter(y, devices, sizes)
    active = [i for i, s in enumerate(sizes) if s > 0]

    def work(i: int):
        def run() -> float:  # run_parallel runs it at the device's (emulated) speed
            loss = F.cross_entropy(lenet(xs[i], device_params[i]), ys[i], reduction="sum")
            loss.backward()
            return float(loss.detach())

        return run

    # The devices work concurrently, as GPUs with asynchronous kernels would.
    losses = hetsplit.run_parallel([work(i) for i in active], [devices[i] for i in active])
    # Summed losses: the full-batch gradient is the plain sum of the shards' gradients.
    hetsplit.reduce_gradients(device_params, sizes, reduction="sum")
    with torch.no_grad():
        for params in device_params:
            for p in params:
                p -= lr * p.grad / len(x)
                p.grad = None
    return sum(losses) / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25", help="comma-separated devices")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds to profile the devices")
    parser.add_argument("--even", action="store_true", help="use the even split, as the course does, to compare")
    add_data_args(parser)
    args = parser.parse_args()

    devices = hetsplit.parse_devices(args.devices)
    train_iter, test_iter, label = load(args, args.batch_size)
    print(f"data: {label}")
    if any(d.emulated for d in devices):
        print("emulated devices:", ", ".join(d.name for d in devices if d.emulated))
    if args.even:
        sizes = [len(part) for part in torch.arange(args.batch_size).tensor_split(len(devices))]  # d2l's split_batch
    else:
        x0, y0 = next(iter(train_iter))
        prof = hetsplit.profile(
            hetsplit.models.lenet(),
            x0[:16],
            devices,
            F.cross_entropy,
            target=y0[:16],
            batch_sizes=[8, 16, 32, 64, 128, 256],
            time_budget=args.budget,
            progress=False,
        )
        sizes = hetsplit.solve(prof, args.batch_size).sizes
    print("split per batch:", dict(zip([d.name for d in devices], sizes)))

    params = init_params()
    device_params = [copy_params(params, d) for d in devices]
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for x, y in train_iter:
            loss = train_batch(x, y, device_params, devices, sizes, args.lr)
        seconds = time.perf_counter() - start
        acc = accuracy(lambda x: lenet(x, device_params[0]), test_iter, devices[0].torch_device)
        print(f"epoch {epoch + 1}: loss {loss:.3f}, test acc {acc:.3f}, {seconds:.1f} s/epoch on {args.devices}")


if __name__ == "__main__":
    main()
