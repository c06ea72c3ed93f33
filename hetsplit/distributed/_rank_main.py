"""A rank of ``hetsplit launch``: register the exit wait for gloo's workers, then run the user's script.

So every rank waits at exit even when the script never calls hetsplit; Ctrl-C ends it quietly (130).
"""

from __future__ import annotations

import os
import runpy
import sys

from .teardown import drain_at_exit

# The exit status of a rank stopped by Ctrl-C: the shell's for SIGINT (128 + 2), as the launcher's.
INTERRUPTED = 130


def main() -> None:
    """Run ``sys.argv[1]`` as ``python SCRIPT ARGS...`` would, with the exit wait registered."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m hetsplit.distributed._rank_main SCRIPT [ARGS...]")
    script = sys.argv[1]
    drain_at_exit()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank (the terminal signals the whole foreground process group),
        # and `hetsplit launch` says the one line, "hetsplit: interrupted": a rank's traceback
        # would only repeat it once per rank. The script's own `finally` blocks have run; the
        # exit skips the interpreter's finalisation, as the launcher's own does after Ctrl-C.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)


if __name__ == "__main__":
    main()
