"""A rank of ``hetsplit launch``: register the exit wait for gloo's workers, then run the user's script.

``hetsplit launch`` starts each rank as ``python -m hetsplit.distributed._rank_main
SCRIPT ARGS...`` (torchrun's ``-m``), so every rank waits at exit for gloo's worker
threads (:func:`hetsplit.distributed.drain_at_exit`) whatever the script does with the
process group, even when it never calls into hetsplit.
"""

from __future__ import annotations

import os
import runpy
import sys

from .teardown import drain_at_exit


def main() -> None:
    """Run ``sys.argv[1]`` as ``python SCRIPT ARGS...`` would, with the exit wait registered."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m hetsplit.distributed._rank_main SCRIPT [ARGS...]")
    script = sys.argv[1]
    drain_at_exit()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
