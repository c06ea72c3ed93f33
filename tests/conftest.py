"""Shared fixtures: a quiet, single-threaded torch and an isolated profile directory."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path):
    # Profiles found on the developer's disk must not change what a test sees.
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(tmp_path / "profiles"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
