"""The console: run lines and the progress display, from process 0 only."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import jax
from tqdm import tqdm

# Off a terminal a bar is noise in a log; print a plain line this often instead,
# and at least this often in seconds (a slow run is never silent for long).
_LOG_FRACTION = 0.1
_LOG_SECONDS = 30.0
# tqdm's own refresh interval: a postfix set more often is never drawn.
_BAR_SECONDS = 0.1


def has_size(stream) -> bool:
    """Whether ``stream`` is a terminal with a size: a terminal without one (some
    job runners' pseudo-terminals) shows no bar, so it gets progress lines instead."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0


class Console:
    """Prints run information from process 0 only, around a progress display.

    On a terminal the progress is a live bar on stderr; elsewhere (logs, CI, a
    terminal with no size) it is a plain line on stdout every tenth of the run,
    and at least every 30 seconds.
    """

    def __init__(self, *, enabled: bool | None = None, interactive: bool | None = None):
        self._enabled = enabled
        if interactive is None:
            interactive = sys.stderr.isatty() and has_size(sys.stderr)
        self._interactive = interactive
        self._bar = None
        self._total = 0
        self._done = self._start = 0
        self._next_log = 0
        self._first: list[str] = []

    @property
    def enabled(self) -> bool:
        # Asked on first use, not at construction: asking JAX which process this
        # is starts its backends, and simulated CPU devices must be set up first.
        if self._enabled is None:
            self._enabled = jax.process_index() == 0
        return self._enabled

    def first(self, text: str) -> None:
        """A line said before the run's first `line`, once the devices are set up (where
        asking which process this is may start the backends)."""
        self._first.append(text)

    def line(self, text: str) -> None:
        """One line on stdout (above the progress bar when one is shown)."""
        if not self.enabled:
            return
        while self._first:
            print(self._first.pop(0), flush=True)
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def start_progress(self, total: int, start: int = 0) -> None:
        """Progress through step ``total``, from step ``start`` (a resumed run's): the
        lines and the bar count the run's steps, the eta this start's pace."""
        self._total, self._done, self._start = total, start, start
        self._said = time.perf_counter()
        self._paced: tuple[float, int] | None = None  # (when, steps done) after the first call
        self._postfixed = -_BAR_SECONDS  # the bar's first advance shows its postfix
        self._next_log = start + max(1, round((total - start) * _LOG_FRACTION))
        if self.enabled and self._interactive:
            self._bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, leave=False
            )

    def shows(self, steps: int) -> bool:
        """Whether advancing by ``steps`` now would show its postfix: a progress line is
        due, or the bar's last postfix is older than its refresh interval. A caller
        reads the figures it shows (a device's loss, say) only then."""
        if not self.enabled:
            return False
        now = time.perf_counter()
        if self._bar is not None:
            return now - self._postfixed >= _BAR_SECONDS
        return self._done + steps >= self._next_log or now - self._said >= _LOG_SECONDS

    def advance(self, steps: int, **postfix: str) -> None:
        """Records ``steps`` more steps done; ``postfix`` (e.g. loss), when given, is shown
        with them (see `shows`)."""
        self._done += steps
        if self._bar is not None:
            if postfix:
                self._postfixed = time.perf_counter()
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)
        elif self._done >= self._next_log or time.perf_counter() - self._said >= _LOG_SECONDS:
            while self._next_log <= self._done:
                self._next_log += max(1, round((self._total - self._start) * _LOG_FRACTION))
            extra = " ".join(f"{key}={value}" for key, value in postfix.items())
            self._said = time.perf_counter()
            self.line(f"step {self._done}/{self._total} {extra}{self._eta()}".replace("  ", " "))
        if self._paced is None:
            self._paced = (time.perf_counter(), self._done)

    def _eta(self) -> str:
        """`` eta=Ns`` at the pace of the steps since the first call (which compiled: a
        20 s compile read as one step's pace said hours for a run of minutes), or nothing
        before there is one."""
        if self._paced is None or self._done == self._paced[1]:
            return ""
        since, done = self._paced
        pace = (self._said - since) / (self._done - done)
        return f" eta={pace * (self._total - self._done):.0f}s"

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def quiet_absl():
    """Hides absl warnings (TFDS and Orbax log through absl) while keeping errors."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
