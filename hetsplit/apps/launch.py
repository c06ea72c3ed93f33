"""Launch: ``hetsplit launch``, one process per device on top of torchrun (``torch.distributed.run``)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

_LOOPBACK = "127.0.0.1"


def torchrun_args(
    devices: str,
    script: str,
    script_args: Sequence[str] = (),
    *,
    nnodes: int | str = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    max_restarts: int = 0,
    rdzv_conf: str = "",
) -> tuple[list[str], list[str]]:
    """The torchrun command line for one process per listed device, and this node's devices.

    ``devices`` lists one device per global rank, the same on every node; each of the
    ``nnodes`` nodes runs ``len(devices) / nnodes`` of them, node ``r`` the ``r``-th slice.
    With ``nnodes="MIN:MAX"`` (elastic) ``devices`` are this node's, and nodes join and leave.

    Raises:
        ValueError: If the devices do not divide evenly over the nodes, a node rank is
            out of range, a multi-node job has no rendezvous endpoint, the endpoint this
            node would host is taken, or a device of this node is not present here;
            before anything starts.
    """
    from ..devices import device_list, parse_devices
    from ..distributed.setup import rank_devices

    if isinstance(nnodes, str) and ":" in nnodes:
        return _elastic_args(devices, script, script_args, nnodes, rdzv_endpoint, rdzv_backend, max_restarts, rdzv_conf)
    if not str(nnodes).isdigit():
        raise ValueError(f"--nnodes {nnodes}: give a number of nodes, or MIN:MAX for nodes that join and leave")
    nnodes = int(nnodes)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is out of range for {nnodes} nodes; give 0 <= --node-rank < --nnodes")
    spec = device_list(devices)
    if len(spec) % nnodes:
        raise ValueError(
            f"{len(spec)} devices cannot be shared evenly by {nnodes} nodes (torchrun runs the same number of "
            "processes on every node); list one device per global rank"
        )
    names = rank_devices(devices, len(spec))
    per_node = len(names) // nnodes
    local = names[node_rank * per_node : (node_rank + 1) * per_node]
    parse_devices(local)  # this node must have its devices: fail here, not in a rank waiting for the others
    argv = ["--nnodes", str(nnodes), "--nproc-per-node", str(per_node), "--max-restarts", str(max_restarts)]
    if nnodes == 1 and rdzv_endpoint is None:
        # One machine: the ranks reach the agent's stores at the loopback address. torch's
        # TCPStore still listens on every interface (it has no bind address); see local_env.
        argv += ["--standalone", "--local-addr", _LOOPBACK]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a job of several nodes needs --rdzv-endpoint HOST:PORT, the same on every node")
        if node_rank == 0:
            _check_endpoint_free(rdzv_endpoint)
        argv += ["--node-rank", str(node_rank), "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", rdzv_endpoint]
    return [*argv, "-m", "hetsplit.distributed._rank_main", script, *script_args], local  # waits for gloo at exit


# A dead node is dropped after 3 missed heartbeats (torch's 5 s each: 15 s), and a round waits
# 30 s for more nodes once MIN are there: 1 s and 2 s restarted this machine's 3-node job in 4-10 s.
_ELASTIC_CONF = "keep_alive_interval=1,last_call_timeout=2"


def _elastic_args(
    devices: str,
    script: str,
    script_args: Sequence[str],
    nnodes: str,
    endpoint: str | None,
    backend: str,
    max_restarts: int,
    conf: str,
) -> tuple[list[str], list[str]]:
    """torchrun's elastic command line (``--nnodes MIN:MAX``): this node's ``devices``, one process each."""
    from ..devices import device_list, parse_devices
    from ..distributed.setup import rank_devices

    low, _, high = nnodes.partition(":")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"--nnodes {nnodes}: give MIN:MAX nodes with 1 <= MIN <= MAX, e.g. 1:4")
    if endpoint is None:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node")
    local = rank_devices(devices, len(device_list(devices)))
    parse_devices(local)
    conf = ",".join(c for c in (_ELASTIC_CONF, conf) if c)  # the user's settings come last, and win
    argv = ["--nnodes", nnodes, "--nproc-per-node", str(len(local)), "--max-restarts", str(max_restarts)]
    argv += ["--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-conf", conf]
    return [*argv, "-m", "hetsplit.distributed._rank_main", script, *script_args], local


def _check_endpoint_free(endpoint: str) -> None:
    """Refuse a rendezvous endpoint on this machine whose port another program holds.

    Node 0 hosts the rendezvous store when the endpoint names this machine (torchrun's
    own rule, reused). If the port is taken, torchrun connects to whatever holds it
    as if it were a store and waits, silent, until its rendezvous times out.

    Raises:
        ValueError: Naming the endpoint and the port, when node 0 would host it here and
            the port cannot be bound.
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from .. import _torch

    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)  # torchrun's default port
    if port == 0 or not _torch.hosts_rendezvous_here(host):
        return  # another machine hosts it (or any free port will do): nothing to check here
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):  # the store listens on both
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is free
            try:
                sock.bind((address, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    continue
                raise ValueError(
                    f"--rdzv-endpoint {endpoint}: port {port} is already in use on this machine, which hosts the "
                    "rendezvous (node 0); pick a free port, or stop the program that holds it"
                ) from None


def local_env(environ: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``environ`` set up for the ranks of a single-machine job: their own sockets on the loopback.

    gloo and NCCL bind their connections between ranks to the interface named in
    ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``; on one machine that is the loopback
    (a value the user set is kept). torchrun's rendezvous store (a ``TCPStore``) cannot
    be bound: it listens on every interface, unauthenticated, for the job's lifetime.

    Returns:
        ``environ`` itself, updated.
    """
    loopback = _loopback_interface()
    if loopback is not None:
        environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return environ


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # no interface list on this platform
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def _failure_line(error: BaseException) -> str:
    """One line for a failed torchrun job: which rank failed first, and how."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return f"the job failed: {error}"
    rank, failure = min(failures.items(), key=lambda item: getattr(item[1], "timestamp", 0))
    message = ""
    path = getattr(failure, "error_file", None)
    if path and Path(path).is_file():
        try:
            message = json.loads(Path(path).read_text())["message"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            message = ""
    code = getattr(failure, "exitcode", None)
    how = (
        f"signal {-code}" if code is not None and code < 0 else f"exit code {code}" if code is not None else "an error"
    )
    tail = f": {str(message).strip().splitlines()[-1]}" if message else " (its output above says why)"
    return f"rank {rank} failed with {how}{tail}; the other ranks were stopped"


def launch(devices: str, script: str, script_args: Sequence[str] = (), **options: Any) -> None:
    """Run ``script`` in one process per device of ``devices``, through torchrun.

    Every process finds its device with :func:`hetsplit.distributed.init`. ``options`` are
    :func:`torchrun_args`'s keywords (``nnodes``, ``node_rank``, ``rdzv_endpoint``, ...).

    Raises:
        ValueError: On a missing script, bad devices or options, before any process starts.
        RuntimeError: One line naming the rank that failed first, when the job fails, or
            the signal that stopped the launcher.
        KeyboardInterrupt: On Ctrl-C, after torchrun has stopped the ranks.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..devices import device_list
    from ..distributed.setup import ENV_DEVICES, rank_devices

    if not os.path.exists(script):  # else every rank starts, each ending in the same traceback
        raise ValueError(f"no such script: {script} (looked in {os.getcwd()}); give the path of the training script")
    argv, _ = torchrun_args(devices, script, script_args, **options)
    # The ranks inherit this process's environment (torchrun's agent starts them); it is put back
    # after, so a caller that launches in-process (a notebook, a test) keeps its own.
    saved = dict(os.environ)
    if "--standalone" in argv:
        local_env(os.environ)
    os.environ[ENV_DEVICES] = ",".join(rank_devices(devices, len(device_list(devices))))
    if "--rdzv-conf" in argv:
        # torch's agents share one worker store across rounds, whose stale keys hung the new
        # world's first collective (and died with the node that hosted it): a fresh store each round.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        raise RuntimeError(_failure_line(e)) from e
    except SignalException as e:  # torchrun's agent turns SIGINT/SIGTERM into this, after stopping the ranks
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None  # the CLI's Ctrl-C: "hetsplit: interrupted", status 130
        raise RuntimeError(f"stopped by {e.sigval.name}; the ranks were stopped") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cmd_launch(args: argparse.Namespace) -> int:
    """``hetsplit launch``: run the job; 0 when every rank succeeded."""
    launch(
        args.devices,
        args.script,
        args.script_args,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        max_restarts=args.max_restarts,
        rdzv_conf=args.rdzv_conf,
    )
    return 0
