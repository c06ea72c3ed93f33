"""Data for the examples: Fashion-MNIST from disk when present, else a labelled synthetic stand-in."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The data options every example shares."""
    parser.add_argument(
        "--data",
        choices=("auto", "fashion-mnist", "synthetic"),
        default="auto",
        help="auto: Fashion-MNIST if found under --data-dir, else synthetic",
    )
    parser.add_argument("--data-dir", default="data", help="where torchvision's FashionMNIST folder is")
    parser.add_argument("--train-size", type=int, default=6000, help="training samples to use")
    parser.add_argument("--test-size", type=int, default=1000, help="test samples to use")


def synthetic(n: int, size: int = 28, seed: int = 0) -> TensorDataset:
    """Learnable synthetic 'images': each class is a fixed random pattern plus noise."""
    gen = torch.Generator().manual_seed(1234)  # the same class patterns for train and test
    templates = F.avg_pool2d(torch.randn(10, 1, size, size, generator=gen), 3, 1, 1) * 3
    gen.manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = templates[labels] + torch.randn(n, 1, size, size, generator=gen)
    return TensorDataset(images, labels)


def load(args: argparse.Namespace, batch_size: int, size: int = 28) -> tuple[DataLoader, DataLoader, str]:
    """Train and test loaders and a label saying which data they hold."""
    root = Path(args.data_dir)
    found = (root / "FashionMNIST" / "raw").is_dir()
    if args.data == "fashion-mnist" and not found:
        raise SystemExit(
            f"Fashion-MNIST not found under {root}/FashionMNIST/raw; this example never downloads, "
            "so copy it there or use --data synthetic"
        )
    if args.data == "fashion-mnist" or (args.data == "auto" and found):
        import torchvision
        from torchvision import transforms

        tf = transforms.Compose([transforms.Resize(size), transforms.ToTensor()])
        train = torchvision.datasets.FashionMNIST(root, train=True, transform=tf, download=False)
        test = torchvision.datasets.FashionMNIST(root, train=False, transform=tf, download=False)
        train = torch.utils.data.Subset(train, range(min(args.train_size, len(train))))
        test = torch.utils.data.Subset(test, range(min(args.test_size, len(test))))
        label = f"Fashion-MNIST from {root} ({len(train)} train / {len(test)} test)"
    else:
        train, test = synthetic(args.train_size, size, seed=1), synthetic(args.test_size, size, seed=2)
        label = f"SYNTHETIC data (class patterns + noise, {args.train_size} train / {args.test_size} test; no download)"
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True),
        DataLoader(test, batch_size=512),
        label,
    )


@torch.no_grad()
def accuracy(predict, loader: DataLoader, device: torch.device) -> float:
    """Fraction of correct predictions of ``predict(x)`` over ``loader``."""
    right = total = 0
    for x, y in loader:
        right += int((predict(x.to(device)).argmax(dim=1).cpu() == y).sum())
        total += len(y)
    return right / max(total, 1)


def run_rank(train: Callable[[argparse.Namespace], None], args: argparse.Namespace, script: str) -> None:
    """Run ``train(args)`` on this rank; a failure ends in one line on stderr and exit status 1.

    ``args.debug`` adds the traceback. The rank leaves without tearing the process group
    down: after a dead or hung peer, gloo's threads still wait on its sockets, and
    destroying the group (explicitly or at interpreter exit) can block or abort with a C++
    message and SIGABRT. Exiting at once also closes this rank's connections, so the
    other ranks fail now instead of at the timeout.
    """
    import hetsplit.distributed as hd

    try:
        train(args)
    except Exception as e:  # one line per failed rank
        if args.debug:
            traceback.print_exc()
        text = " ".join(str(e).split()) or "(no message)"
        if not isinstance(e, hd.DistributedError) and "RANK" in os.environ:
            text = f"rank {os.environ['RANK']}: {text}"
        print(f"{script}: {type(e).__name__}: {text}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
