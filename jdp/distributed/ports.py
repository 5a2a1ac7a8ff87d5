"""A port for a run's coordinator to listen on: free now, and not one the machine may give
an outgoing connection before the coordinator binds it."""

from __future__ import annotations

import contextlib
import random
import socket

# Ports tried for a coordinator: below every common system's range for outgoing
# connections (Linux 32768-60999, macOS 49152-65535), so that a connection made between
# the pick and the coordinator's bind cannot take the port, and below Kubernetes'
# NodePorts (30000-32767), which a node's proxy may take over.
LISTEN_PORTS = range(20000, 30000)


def outgoing_ports() -> range:
    """The ports this machine gives outgoing connections, where the system says (Linux)."""
    path = "/proc/sys/net/ipv4/ip_local_port_range"
    with contextlib.suppress(OSError, ValueError), open(path) as ports:
        low, high = map(int, ports.read().split())
        return range(low, high + 1)
    return range(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing holds right now and no outgoing connection will
    be given: one of ``LISTEN_PORTS`` outside this machine's outgoing range, tried by a
    bind (a bind to port 0 would pick one inside that range)."""
    outgoing = outgoing_ports()
    ports = [port for port in LISTEN_PORTS if port not in outgoing]
    for port in random.sample(ports, min(len(ports), 64)):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind((host, port))
            return port
    with socket.socket() as probe:  # every port was held, or the range covers them all
        probe.bind((host, 0))
        return probe.getsockname()[1]
