"""Every example runs end to end on synthetic data, offline (one subprocess each)."""

import subprocess
import sys

import pytest
from helpers import ROOT, launch, subprocess_env

EXAMPLES = ROOT / "examples"


def _run(name, *args):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True, text=True, timeout=240, cwd=EXAMPLES, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_lenet_from_scratch():
    out = _run(
        "lenet_from_scratch.py",
        "--devices",
        "cpu,cpu@0.5",
        "--data",
        "synthetic",
        "--epochs",
        "2",
        "--train-size",
        "1024",
        "--test-size",
        "256",
        "--batch-size",
        "128",
        "--budget",
        "1",
    )
    assert "SYNTHETIC" in out and "emulated devices: cpu@0.5" in out and "split per batch" in out
    accs = [float(line.split("test acc ")[1].split(",")[0]) for line in out.splitlines() if "test acc" in line]
    assert len(accs) == 2 and accs[-1] > 0.3  # learns the synthetic classes (chance is 0.1)


def test_resnet18_dataparallel():
    out = _run(
        "resnet18_dataparallel.py",
        "--devices",
        "cpu,cpu@0.5",
        "--data",
        "synthetic",
        "--train-size",
        "512",
        "--test-size",
        "64",
        "--batch-size",
        "32",
        "--image-size",
        "8",
        "--budget",
        "1",
    )
    assert "SYNTHETIC" in out and out.count("s/epoch") == 1 and "emulated: cpu@0.5" in out
    acc = float(out.split("test acc ")[1].split(",")[0])
    assert acc > 0.3, out  # 16 steps learn the synthetic classes (chance is 0.1; it stayed at 0.10 before)


def test_dataparallel_tutorial_shows_uneven_sizes():
    out = _run(
        "dataparallel_tutorial.py",
        "--devices",
        "cpu,cpu@0.5",
        "--weights",
        "3,1",
        "--batch-size",
        "40",
        "--data-size",
        "40",
    )
    assert "input size (30, 5)" in out and "input size (10, 5)" in out and "synthetic" in out
    assert "rows per device: cpu 30, cpu@0.5 (emulated) 10" in out and " on cpu" not in out  # was "on cpu" for both


def test_split_a_batch():
    out = _run("split_a_batch.py", "--devices", "cpu,cpu@0.5", "--batch-size", "64", "--budget", "1")
    assert "scattered and gathered back exactly" in out and "synthetic" in out


@pytest.mark.parametrize("name", ["lenet_from_scratch.py", "resnet18_dataparallel.py"])
def test_missing_fashion_mnist_is_explained(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--data", "fashion-mnist", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES,
        env=subprocess_env(),
    )
    assert proc.returncode != 0 and "never downloads" in proc.stderr


def _lenet_from_scratch():
    """The course's from-scratch example, imported as a module (its helpers import from examples/)."""
    import importlib.util

    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("lenet_from_scratch", EXAMPLES / "lenet_from_scratch.py")
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
    finally:
        sys.path.remove(str(EXAMPLES))
    return example


def test_lenet_from_scratch_step_equals_one_full_batch_step():
    """One two-device SGD step of the course's loop (cpu and cpu@1 share one CPU) is one full-batch step."""

    import torch
    import torch.nn.functional as F

    import hetsplit

    example = _lenet_from_scratch()
    params = [p.double() for p in example.init_params()]
    devices = hetsplit.parse_devices("cpu,cpu@1")
    device_params = [example.copy_params(params, d) for d in devices]
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 1, 28, 28, dtype=torch.float64, generator=gen), torch.randint(0, 10, (10,), generator=gen)
    example.train_batch(x, y, device_params, devices, [7, 3], lr=0.5)
    ref = [p.clone().requires_grad_() for p in params]
    F.cross_entropy(example.lenet(x, ref), y).backward()
    expected = [p.detach() - 0.5 * p.grad for p in ref]
    for copy in device_params:  # both devices' copies took exactly the one full-batch step
        for got, want in zip(copy, expected):
            torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-14)


def test_fsdp_hetero_under_hetsplit_launch(tmp_path):
    """The FSDP2 example on the emulated pair (the second rank a quarter as fast, 8 samples at once), a few steps."""
    import transformers  # noqa: F401  (a test extra: missing, fail; never skip)

    proc = launch(
        "cpu,cpu@0.25:max8", EXAMPLES / "fsdp_hetero.py", "--steps", "3", "--budget", "1", "--threads", "1",
        "--timeout", "60", "--save", tmp_path / "ckpt", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 ranks on cpu, cpu@0.25:max8 (gloo)" in out and "SYNTHETIC" in out and "sharded over 2 ranks" in out
    assert "plan: rank0:cpu " in out and "3 steps in" in out and "saved a sharded checkpoint" in out
    line = next(x for x in out.splitlines() if "plan: rank0:cpu " in x)  # the example's line (hd.plan says one too)
    share = int(line.split("rank1:cpu@0.25:max8 ")[1].split()[0])
    assert 0 <= share < 32  # the slow rank gets less than the half an even split would give it
    micro = line.split("rank1:cpu@0.25:max8 ")[1].split(" as ")[1]
    assert all(int(m) <= 8 for m in micro.strip("[]").split(",") if m.strip())  # its memory of 8 samples
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_lenet_from_scratch_on_an_emulated_device_equals_one_device():
    """On cpu + cpu@0.25 (one torch device) the course's loop applies each update once, as on cpu alone."""

    import torch

    import hetsplit

    example = _lenet_from_scratch()
    params = [p.double() for p in example.init_params()]
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 1, 28, 28, dtype=torch.float64, generator=gen), torch.randint(0, 10, (8,))) for _ in range(3)
    ]

    def run(devices, sizes):
        devs = hetsplit.parse_devices(devices)
        device_params = [example.copy_params(params, d) for d in devs]
        for x, y in batches:
            example.train_batch(x, y, device_params, devs, sizes, lr=0.5)
        return device_params

    one = run("cpu", [8])[0]
    for copy in run("cpu,cpu@0.25", [6, 2]):  # shared copies would take each step twice (and be refused)
        for got, want in zip(copy, one):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-14)
