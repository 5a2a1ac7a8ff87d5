"""A launched process's output as the launcher relays it: each line prefixed with the
process's rank, and the collectives library's connection lines dropped."""

from __future__ import annotations

import re
import threading
from typing import TextIO

# The collectives library's word that each process reached its peers: one line per
# process, every run, saying nothing a user acts on (a failure to connect still shows).
# Written by several threads at once it can come interleaved ("[Gloo] Rank [Gloo] Rank 0
# is connected ..." and "0 is connected ..."): each piece ends as the message does, or
# without its count, which then comes alone on the next line ("... is : " and "7").
CONNECTED = re.compile(r"Expected number of connected peer ranks is :( ?\d+)?$")


class ConnectionLines:
    """Which lines of one process's output are the connection messages, pieces and all."""

    def __init__(self) -> None:
        self.cut = False  # the last line dropped ended before its count

    def drops(self, line: str) -> bool:
        text, cut = line.rstrip(), self.cut
        self.cut = False
        if cut and text.isdigit():  # the count the line before was cut from
            return True
        match = CONNECTED.search(text)
        self.cut = bool(match) and match.group(1) is None
        return bool(match)


def relay(stream, rank: int, out: TextIO, lock: threading.Lock) -> None:
    """Writes each line of ``stream`` (a process's output) to ``out`` as ``[rank] line``,
    under ``lock``, but for the connection lines; closes ``stream`` at its end."""
    connection = ConnectionLines()
    for line in iter(stream.readline, ""):
        if connection.drops(line):
            continue
        with lock:
            out.write(f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
            out.flush()
    stream.close()
