"""The guides' code runs as written: every ``python`` block of the README's one-process section and the guides.

A guide's blocks run in order in one namespace (a later block uses what an earlier one
made), in a fresh working directory, as a reader would paste them.
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def _readme_one_process() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## One process")
    return text[start : text.index("\n## ", start + 1)]


GUIDES = {
    "README one process": _readme_one_process,
    "docs/one-process.md": lambda: (ROOT / "docs" / "one-process.md").read_text(encoding="utf-8"),
}


@pytest.mark.parametrize("guide", list(GUIDES))
def test_every_code_block_runs(guide, tmp_path, monkeypatch):
    blocks = _blocks(GUIDES[guide]())
    assert blocks, f"{guide} has no python block"
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)  # the guides' timings are steadiest on one thread; conftest restores it
    namespace: dict = {"__name__": "__guide__"}
    for k, code in enumerate(blocks):
        try:
            exec(compile(code, f"{guide} block {k + 1}", "exec"), namespace)
        except Exception as e:  # name the block: the reader's line to fix
            raise AssertionError(f"{guide}, block {k + 1} failed: {type(e).__name__}: {e}\n{code}") from e
