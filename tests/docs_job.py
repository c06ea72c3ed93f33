"""One rank of a guide's two-rank job, behind tests/test_docs.py: ``hetsplit launch ... docs_job.py UNITS OUT``.

UNITS (JSON) lists units: a setup's code, the guide's blocks that follow it, the code that
completes them, and for each unit after the first a free port. Each unit runs as a script
of its own would: in a namespace of its own, the process group of the unit before
destroyed and accelerate's singletons reset, its own rendezvous in a new store that rank 0
hosts on the unit's port (in torchrun's store a new group's keys are the old one's, and a
rank could read the other's old address). Each rank writes ``OUT/rank{r}.json``: for each
block, ``null`` when it ran, else the traceback. A failure ends the job at once, so that
the other rank is not left waiting in a collective until its timeout.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main() -> None:
    units = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2]) / f"rank{os.environ['RANK']}.json"
    results: dict[str, str | None] = {}
    for unit in units:
        if "port" in unit:
            _fresh_group(unit["port"])
        namespace = {"__name__": "__main__"}
        blocks = unit["blocks"]
        steps = [(f"setup {unit['setup']!r}", unit["before"], blocks[0]["id"], None)]
        steps += [(b["id"], b["code"], b["id"], b["id"] if b is not blocks[-1] else None) for b in blocks]
        steps += [(f"setup {unit['setup']!r}, after the blocks", unit["after"], blocks[-1]["id"], blocks[-1]["id"])]
        for name, code, blame, done in steps:  # a failure is the block's it prepares or completes
            try:
                exec(compile(code, name, "exec"), namespace)
            except BaseException:
                results[blame] = f"{name} failed:\n{traceback.format_exc()}"
                out.write_text(json.dumps(results))
                sys.stdout.flush()
                os._exit(1)  # the launcher then stops the other rank
            if done is not None:
                results[done] = None
                out.write_text(json.dumps(results))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _fresh_group(port: int) -> None:
    """Destroy the process group the unit before left; the next rendezvous is a new store on ``port``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if "accelerate" in sys.modules:  # accelerate keeps the process's state in singletons: a new script has none
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")


if __name__ == "__main__":
    main()
