"""The processes of a run meet on the coordinator port before JAX connects.

JAX's own start-up, when a process never comes, aborts every process after its
timeout without saying which one is missing; this handshake names it. Process 0
listens where JAX's service will listen next; the others report in with their
settings, and each gets an answer: go on, or the one-line reason it cannot (a
missing process, a duplicate id, or settings that differ from process 0's,
which would otherwise train apart or hang in a collective).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

from jdp.distributed.cluster import ENV_COORDINATOR_BIND, Cluster, split_address
from jdp.errors import UsageError

_HELLO = "jdp-hello/3"
# Process 0's first words to each process that connects: what tells it from another
# program that holds the port (which would leave the process waiting its whole
# start-up timeout, and then blaming process 0).
_GREETING = "jdp-coordinator/3"
# How long a process waits for the greeting once connected: process 0 greets within a
# second of a connection (its accept loop), or within one other process's hello (5 s).
_GREETING_SECONDS = 15.0

Settings = dict[str, object]
_ERROR = "jdp_start_up_error"  # a key of the settings: this process's start-up error


def handshake(
    cluster: Cluster, timeout: float, settings: Settings | None = None, error: str | None = None
) -> None:
    """Waits until every process has reached process 0, naming those that did not.

    ``settings`` (JSON values by flag name) must be the same in every process;
    a process whose settings differ stops every process, naming the flags.
    ``error``: this process cannot run (its data is missing, say); every process
    stops with it, instead of waiting for it in a collective.
    """
    settings = dict(settings or {})
    if error:
        settings[_ERROR] = f"process {cluster.process_id}: {error}"
    if cluster.process_id == 0:
        _gather(cluster, timeout, settings)
    else:
        _report(cluster, timeout, settings)


def _listen(cluster: Cluster) -> socket.socket:
    """Process 0's handshake socket: where JAX's service will listen next."""
    port = split_address(cluster.bind or cluster.coordinator, "coordinator")[1]
    try:
        if cluster.bind:
            host = split_address(cluster.bind, ENV_COORDINATOR_BIND)[0]
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return socket.create_server((host, port), family=family)
        if socket.has_dualstack_ipv6():  # every interface, IPv4 and IPv6, as JAX's service
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as error:
        raise UsageError(
            f"process 0 cannot listen on port {port} ({error.strerror or error}); choose a "
            "free port in --coordinator"
        ) from None


def _gather(cluster: Cluster, timeout: float, settings: Settings) -> None:
    own_error = settings.pop(_ERROR, None)
    deadline = time.monotonic() + timeout
    arrived: dict[int, socket.socket] = {}
    message = None
    with _listen(cluster) as server:
        try:
            while message is None:
                _drop_departed(arrived)
                if len(arrived) == cluster.num_processes - 1:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in range(1, cluster.num_processes) if p not in arrived]
                    message = _missing_message(missing, cluster, timeout)
                    break
                server.settimeout(min(left, 1.0))
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:  # an aborted connection, or out of file descriptors
                    time.sleep(0.1)
                    continue
                _send(connection, _GREETING)
                message = _admit(connection, cluster, arrived, settings)
            message = own_error or message
            reply = f"error {message}" if message else "go"
            for connection in arrived.values():
                _send(connection, reply)
            for connection in arrived.values():  # the peers close first (TIME_WAIT stays there)
                connection.settimeout(5)
                with contextlib.suppress(OSError):
                    connection.recv(1)
        finally:
            for connection in arrived.values():
                connection.close()
    if message:
        raise UsageError(message)


def _drop_departed(arrived: dict[int, socket.socket]) -> None:
    """Forgets processes whose connection closed while they waited (they gave up or died)."""
    for index, connection in list(arrived.items()):
        try:
            departed = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            departed = False  # open, nothing to read: still waiting for the verdict
        except OSError:
            departed = True
        if departed:
            connection.close()
            del arrived[index]


def _admit(
    connection: socket.socket, cluster: Cluster, arrived: dict, settings: Settings
) -> str | None:
    """Reads one process's hello and keeps its connection; returns what is wrong, if anything."""
    connection.settimeout(5)
    try:
        words = connection.makefile("r").readline().rstrip("\n").split(" ", 3)
        theirs = json.loads(words[3]) if len(words) == 4 else None
    except (OSError, ValueError):
        words, theirs = [], None
    if (
        len(words) != 4
        or words[0] != _HELLO
        or not (words[1] + words[2]).isdigit()
        or not isinstance(theirs, dict)
    ):
        connection.close()  # not a jdp process: a port scanner, a health probe
        return None
    index, count = int(words[1]), int(words[2])
    problem = theirs.pop(_ERROR, None) or _differences(index, theirs, settings)
    if not problem and count != cluster.num_processes:
        problem = (
            f"process {index} was started with --num-processes {count}, process 0 with "
            f"{cluster.num_processes}; start every process with the same count"
        )
    elif not problem and index in arrived:
        problem = f"two processes were started with --process-id {index}; give each its own id"
    if problem:
        _send(connection, f"error {problem}")
        connection.close()
        return problem
    connection.settimeout(None)
    arrived[index] = connection
    return None


def _differences(index: int, theirs: Settings, settings: Settings) -> str | None:
    """The flags on which process ``index`` differs from process 0, as one line."""
    differ = sorted(
        name for name in settings.keys() | theirs.keys() if settings.get(name) != theirs.get(name)
    )
    if not differ:
        return None
    shown = "; ".join(
        f"--{name.replace('_', '-')} {theirs.get(name)} in process {index}, "
        f"{settings.get(name)} in process 0"
        for name in differ[:4]
    )
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    return (
        f"the processes were started with different flags: {shown}{more}; start every "
        "process with the same flags"
    )


def _missing_message(missing: list[int], cluster: Cluster, timeout: float) -> str:
    names = ", ".join(map(str, missing))
    noun = "process" if len(missing) == 1 else "processes"
    return (
        f"{noun} {names} of {cluster.num_processes} did not reach the coordinator "
        f"{cluster.coordinator} within {timeout:g} s; start {'it' if len(missing) == 1 else 'them'}"
        " with the same --coordinator and --num-processes, or raise --startup-timeout"
    )


def _greeted(connection: socket.socket, reader, coordinator: str) -> None:
    """UsageError unless what answered at ``coordinator`` greets as jdp's process 0."""
    connection.settimeout(_GREETING_SECONDS)
    try:
        greeting = reader.readline().strip()
    except OSError:  # silent: a server that waits for a request of its own kind
        greeting = None
    if greeting != _GREETING:
        said = "said nothing" if not greeting else f"said {greeting[:40]!r}"
        raise UsageError(
            f"another program holds the coordinator's port {coordinator} (it {said} where "
            "jdp's process 0 greets); choose a free port in --coordinator for every process"
        )


def _send(connection: socket.socket, text: str) -> None:
    with contextlib.suppress(OSError):
        connection.sendall(text.encode() + b"\n")


def _report(cluster: Cluster, timeout: float, settings: Settings) -> None:
    host, port = split_address(cluster.coordinator, "--coordinator")
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            connection = socket.create_connection((host, port), timeout=min(left, 2.0))
        except OSError:
            time.sleep(min(0.2, max(left, 0)))
            continue
        with connection:
            reader = connection.makefile("r")
            _greeted(connection, reader, cluster.coordinator)
            _send(
                connection,
                f"{_HELLO} {cluster.process_id} {cluster.num_processes} {json.dumps(settings)}",
            )
            # Process 0 answers by its own deadline, at most `timeout` from now (it is
            # listening already); until then this process waits, whatever its own
            # deadline, so that it is not counted and then lost.
            connection.settimeout(timeout + 10)
            try:
                reply = reader.readline().strip()
            except OSError:
                reply = ""
        if reply == "go":
            return
        if reply.startswith("error "):
            raise UsageError(reply.removeprefix("error "))
        time.sleep(0.2)  # something else answered on the port; try again
    raise UsageError(
        f"process 0 did not answer at {cluster.coordinator} within {timeout:g} s; check that "
        "it runs, that --coordinator names its host and port, and that the port is reachable"
    )
