"""Shared fixtures: a quiet, single-threaded torch and an isolated profile directory; the slowest modules first."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path):
    # Profiles found on the developer's disk must not change what a test sees.
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(tmp_path / "profiles"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# Modules whose jobs take tens of seconds (multi-process launches, framework imports). The
# two xdist workers take whole modules in collection order, so the slowest go first and
# the short ones fill in at the end, instead of one long module starting last while the
# other worker sits idle.
_SLOW_FIRST = (
    "test_integration_scenarios.py",
    "test_exit.py",
    "test_hf_trainer.py",
    "test_docs.py",
    "test_examples.py",
    "test_accelerate.py",
    "test_lightning.py",
    "test_launch.py",
    "test_fsdp.py",
    "test_distributed.py",
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
