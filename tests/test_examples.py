"""Every example runs end to end on synthetic data, offline (one subprocess each)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name, *args):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=240, cwd=EXAMPLES
    )
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
    )
    assert "SYNTHETIC" in out and "emulated devices: cpu@0.5" in out and "split per batch" in out
    accs = [float(line.split("test acc ")[1].split(",")[0]) for line in out.splitlines() if "test acc" in line]
    assert len(accs) == 2 and accs[-1] > 0.3  # learns the synthetic classes (chance is 0.1)


def test_resnet18_dataparallel():
    out = _run(
        "resnet18_dataparallel.py",
        "--devices",
        "cpu",
        "--devices",
        "cpu,cpu@0.5",
        "--data",
        "synthetic",
        "--train-size",
        "64",
        "--test-size",
        "32",
        "--batch-size",
        "32",
        "--image-size",
        "16",
        "--profile-budget",
        "3",
    )
    assert "SYNTHETIC" in out and out.count("s/epoch") == 2 and "emulated: cpu@0.5" in out


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


def test_split_a_batch():
    out = _run("split_a_batch.py", "--devices", "cpu,cpu@0.5", "--batch-size", "64", "--budget", "3")
    assert "scattered and gathered back exactly" in out and "synthetic" in out


@pytest.mark.parametrize("name", ["lenet_from_scratch.py", "resnet18_dataparallel.py"])
def test_missing_fashion_mnist_is_explained(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--data", "fashion-mnist", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES,
    )
    assert proc.returncode != 0 and "never downloads" in proc.stderr
