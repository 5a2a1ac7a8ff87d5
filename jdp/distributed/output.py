"""A launched process's output as the launcher relays it: each line prefixed with the
process's rank, and the collectives library's connection lines dropped."""

from __future__ import annotations

import re
import threading
from typing import TextIO

# The collectives library's word that each process reached its peers: one line per
# thread, every run, saying nothing a user acts on (a failure to connect still shows). Each
# line is written as pieces ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer
# ranks. ", "Expected number of connected peer ranks is : ", the count, the line's end), and
# threads writing at once interleave them anywhere: "[Gloo] Rank 4 is connected to 7 peer
# ranks. [Gloo] Rank 7Expected number of ... is :  is connected to 77", or a line cut before
# its counts, which then come alone (or as an empty line) next.
PIECES = re.compile(
    r"\[Gloo\] Rank|is connected to|Expected number of connected peer ranks is :|peer ranks\."
)
COUNTS = re.compile(r"[\d\s]*")


class ConnectionLines:
    """Which lines of one process's output are the connection messages, pieces and all: a
    line of nothing but their pieces and numbers, and the numbers or empty lines after it."""

    def __init__(self) -> None:
        self.after = False  # the line before was dropped: its counts may come next

    def drops(self, line: str) -> bool:
        text, after = line.rstrip("\n"), self.after
        rest, pieces = PIECES.subn("", text)
        self.after = pieces > 0 and COUNTS.fullmatch(rest) is not None
        self.after |= after and COUNTS.fullmatch(text) is not None
        return self.after


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
