"""A launched process's output as the launcher relays it: each line prefixed with the
process's rank, and the collectives library's connection lines dropped."""

from __future__ import annotations

import re
import threading
from typing import TextIO

# The collectives library's word that each process reached its peers: one line per
# thread, every run, saying nothing a user acts on (a line whose peers fall short of those
# expected still shows, as does a failure to connect). Each line is written as pieces
# ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer ranks. ", "Expected
# number of connected peer ranks is : ", the count, the line's end), and threads writing
# at once interleave them anywhere: "[Gloo] Rank 4 is connected to 7 peer ranks. [Gloo]
# Rank 7Expected number of ... is :  is connected to 77", the rest of the second message
# then on the next line, or its count or its line's end alone.
PIECES = re.compile(
    r"\[Gloo\] Rank|is connected to|Expected number of connected peer ranks is :|peer ranks\."
)
COUNTS = re.compile(r"[\d\s]*")
BEGINS = "[Gloo] Rank"
WHOLE = re.compile(
    r"is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : (\d+)"
)


class ConnectionLines:
    """Which lines of one process's output are the connection messages, pieces and all: a
    line of nothing but their pieces and numbers, and the counts or empty lines owed by
    the messages a dropped line began and did not end."""

    def __init__(self) -> None:
        self.owed = 0  # line ends still to come of messages begun on dropped lines

    def drops(self, line: str) -> bool:
        text = line.rstrip("\n")
        rest, pieces = PIECES.subn("", text)
        if pieces and COUNTS.fullmatch(rest):
            whole = WHOLE.search(text)
            if whole and whole[1] != whole[2]:  # fewer peers than expected: a user's to see
                return False
            # This line ends one message; any other it begins ends on a later line.
            self.owed = max(0, self.owed + text.count(BEGINS) - 1)
            return True
        if self.owed and COUNTS.fullmatch(text):  # an owed count, or a line's end
            self.owed -= 1
            return True
        return False


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
