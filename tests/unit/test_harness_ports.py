"""The rendezvous ports the tests' process groups listen on: never one the kernel hands to outgoing connections
(its ephemeral range), never one already taken, never the same twice in a test process."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.dist.harness import free_port


def test_ports_come_from_below_the_ephemeral_range_and_skip_taken_ones() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    first = free_port()
    with socket.socket() as taken:
        taken.bind(("", first + 1))  # the next port of this worker's slice is someone else's now
        taken.listen()
        second = free_port()
    assert first < low and second < low, (first, second, low)
    assert second > first + 1  # handed out once, and the taken one skipped
