"""The support window: what pyproject.toml declares is what the code refuses below, in one line."""

import importlib.metadata
import re
from pathlib import Path

import pytest

from hetsplit import _torch
from hetsplit.integrations import versions

PYPROJECT = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)


def _floor(package: str) -> str:
    return re.findall(rf'"{package}>=([\d.]+)"', PYPROJECT)[0]


def test_the_declared_floors_are_the_ones_the_code_refuses_below():
    assert _floor("torch") == ".".join(map(str, _torch.MIN_TORCH))
    for package, minimum in versions.MINIMUM.items():
        assert _floor(package) == minimum, package


@pytest.mark.parametrize("package", sorted(versions.MINIMUM))
def test_an_older_framework_is_refused_in_one_line_before_it_is_imported(monkeypatch, package):
    need = versions.MINIMUM[package]
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.0" if name == package else real(name))
    with pytest.raises(ImportError) as caught:
        versions.require(package, f"hetsplit.{package}")
    line = str(caught.value)
    assert "\n" not in line and f"{package} >= {need}" in line and f"{package} 0.1.0 is installed" in line
    monkeypatch.setattr(importlib.metadata, "version", lambda name: need + ".post1+local" if name == package else "")
    versions.require(package, f"hetsplit.{package}")  # the floor itself, and a local build of it, pass


def test_a_framework_not_installed_is_named_with_its_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"^hetsplit.lightning needs lightning >= 2.3, which is not installed: pip "):
        versions.require("lightning", "hetsplit.lightning")
