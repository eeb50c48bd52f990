"""Ports for the servers that tests and benchmarks start on one machine.

A port the OS hands out for ``bind(0)`` lies in the ephemeral range, which every outgoing
connection on the machine also draws from (a test's own HTTP polling included). Between the
check and the server's own bind such a port can be taken: CI saw SGLang's torch.distributed store
fail with EADDRINUSE on the port that SGLang had picked that way. Ports drawn below the
ephemeral range can only be taken by another listener.
"""

from __future__ import annotations

import random
import socket

LOWEST_PORT = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_DRAWS = random.SystemRandom()  # independent of any test's random.seed


def ephemeral_start() -> int:
    """The first port of the OS's ephemeral range (Linux's default when unreadable)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port below the ephemeral range; the OS's choice if none is free there."""
    highest = ephemeral_start() - 1
    if highest > LOWEST_PORT:
        for _ in range(200):
            port = _DRAWS.randrange(LOWEST_PORT, highest)
            if port_is_free(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_nccl_port(words: list[str]) -> list[str]:
    """launch_server words with ``--nccl-port`` set (SGLang would take an ephemeral one)."""
    if any(w == "--nccl-port" or w.startswith("--nccl-port=") for w in words):
        return list(words)
    return [*words, "--nccl-port", str(free_port())]
