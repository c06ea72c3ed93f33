"""One rank of a guide's two-rank job, behind tests/test_docs.py: ``hetsplit launch ... docs_job.py UNITS OUT``.

UNITS (JSON) lists units: a setup's code, the guide's blocks that follow it, and the code
that completes them. Each unit runs as a script of its own would: in a namespace of its
own, the process group of the unit before destroyed. Its next one meets in a new store
(rank 0 hosts it on a free port): in torchrun's, the new group's keys would be the old
one's, and a rank could read the other's old address. Each rank writes ``OUT/rank{r}.json``: for each
block, ``null`` when it ran, else the traceback. A failure ends the job at once, so that the
other rank is not left waiting in a collective until its timeout.
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
        _fresh_group()
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


def _fresh_group() -> None:
    """Destroy the process group a unit left; the next one's rendezvous is a new store of rank 0's."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    port = [None]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]), TORCHELASTIC_USE_AGENT_STORE="False")


if __name__ == "__main__":
    main()
