"""Ports for the servers tests start: below the ephemeral range, and SGLang's NCCL port set."""

from __future__ import annotations

import socket

from benchmarks.ports import LOWEST_PORT, ephemeral_start, free_port, port_is_free, with_nccl_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    for _ in range(20):
        port = free_port()
        assert LOWEST_PORT <= port < ephemeral_start()
        assert port_is_free(port)


def test_a_listening_port_is_not_free() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        assert not port_is_free(s.getsockname()[1])


def test_the_nccl_port_is_added_once() -> None:
    words = with_nccl_port(["--device", "cpu"])
    assert words[:2] == ["--device", "cpu"] and words[2] == "--nccl-port"
    assert LOWEST_PORT <= int(words[3]) < ephemeral_start()
    assert with_nccl_port(words) == words
    assert with_nccl_port(["--nccl-port=1234"]) == ["--nccl-port=1234"]
