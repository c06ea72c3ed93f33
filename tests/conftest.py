"""Shared fixtures: a quiet, single-threaded torch and an isolated profile directory; the slowest modules first."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path):
    # Profiles found on the developer's disk must not change what a test sees.
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(tmp_path / "profiles"))
    # Nor a device list: neither the developer's nor one an in-process `hetsplit launch` (test_launch.py)
    # leaves in os.environ for its ranks, which a later module on the same xdist worker would read.
    monkeypatch.delenv("HETSPLIT_DEVICES", raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# Modules whose jobs take tens of seconds (multi-process launches, framework imports), the
# longest first, as measured on the 2-vCPU VM. The two xdist workers take whole modules in
# collection order (pyproject's --no-loadscope-reorder: xdist would otherwise hand out the
# modules with the most tests first, and these few-test modules came last, one of them
# running alone at the end): the slowest go first and the short ones fill in at the end.
_SLOW_FIRST = (
    "test_docs.py",
    "test_examples.py",
    "test_hf_trainer.py",
    "test_accelerate.py",
    "test_launch.py",
    "test_elastic.py",
    "test_cli.py",
    "test_fsdp.py",
    "test_faults.py",
    "test_lightning.py",
    "test_exit.py",
    "test_profiler.py",
    "test_distributed.py",
    "test_journeys.py",
    "test_oom_backward.py",
    "test_data_parallel.py",
    "test_distributed_rebalance.py",
    "test_solver.py",
    "test_trainer_eval.py",
    "test_bad_inputs.py",
    "test_apply.py",
    "test_micro.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    # The README's second command runs only the serial tests (-m serial). Collecting every
    # module for it would import Lightning, transformers and accelerate (~10 s on two cores)
    # to deselect them all, so a module that never mentions the marker is not collected.
    if config.getoption("markexpr") != "serial" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "serial" not in collection_path.read_text(encoding="utf-8")
