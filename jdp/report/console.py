"""The console: run lines and the progress display, from process 0 only."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import jax
from tqdm import tqdm

# Off a terminal a bar is noise in a log; print a plain line this often instead.
_LOG_FRACTION = 0.1


class Console:
    """Prints run information from process 0 only, around a progress display.

    On a terminal the progress is a live bar on stderr; elsewhere (logs, CI) it
    is a plain line on stdout every tenth of the run.
    """

    def __init__(self, *, enabled: bool | None = None, interactive: bool | None = None):
        self._enabled = enabled
        self._interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = None
        self._total = 0
        self._done = 0
        self._next_log = 0

    @property
    def enabled(self) -> bool:
        # Asked on first use, not at construction: asking JAX which process this
        # is starts its backends, and simulated CPU devices must be set up first.
        if self._enabled is None:
            self._enabled = jax.process_index() == 0
        return self._enabled

    def line(self, text: str) -> None:
        """One line on stdout (above the progress bar when one is shown)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def start_progress(self, total: int) -> None:
        self._total, self._done = total, 0
        self._started = time.perf_counter()
        self._next_log = max(1, round(total * _LOG_FRACTION))
        if self.enabled and self._interactive:
            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)

    def advance(self, steps: int, **postfix: str) -> None:
        """Records ``steps`` more steps done; ``postfix`` (e.g. loss) is shown with them."""
        self._done += steps
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)
        elif self._done >= self._next_log:
            self._next_log += max(1, round(self._total * _LOG_FRACTION))
            extra = " ".join(f"{key}={value}" for key, value in postfix.items())
            elapsed = time.perf_counter() - self._started
            eta = elapsed / self._done * (self._total - self._done)
            self.line(f"step {self._done}/{self._total} {extra} eta={eta:.0f}s".replace("  ", " "))

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
