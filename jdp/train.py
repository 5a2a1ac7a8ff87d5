"""``python -m jdp.train``: parse the flags, call `jdp.fit`, print one summary line (a
language model's run prints a short sample of its text before it)."""

from __future__ import annotations

import _thread
import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from jdp.distributed.leaving import Listening, tell_the_others
from jdp.errors import (
    DataLedgerError,
    LoaderError,
    NonFiniteError,
    ReplicaMismatchError,
    UsageError,
)
from jdp.tool import command
from jdp.training.flags import parse_command, parse_flags  # noqa: F401 (jdp.train.parse_flags)


class _Interrupted(BaseException):
    """A signal before the training loop took signals over (or after it let go). Not an
    `Exception`, as KeyboardInterrupt is not: start-up code that turns a library's failure
    into its own answer (``except Exception``) must not swallow it."""


def _interrupt(number, frame) -> None:
    raise _Interrupted(signal.Signals(number).name)


def _interrupt_again(previous):
    """An unraisable-exception hook that sends the signal again when `_interrupt` raised
    where Python swallows exceptions: a gc callback (JAX's frees buffers in one) or a
    ``__del__``. There the exception is printed as ``Exception ignored`` and the run
    would go on, as if the Ctrl-C had never come. The signal is sent again, from another
    thread a moment later (sent from the hook, it would land in the hook and be swallowed
    there too), while `_interrupt` still takes it."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, _Interrupted):
            # A bare thread: `threading`'s would take its module's lock, which the code
            # the signal interrupted may hold.
            _thread.start_new_thread(_send_again, (signal.Signals[str(unraisable.exc_value)],))
        else:
            previous(unraisable)

    hook.jdp_interrupts = True
    return hook


def _send_again(number: signal.Signals) -> None:
    time.sleep(0.01)
    if signal.getsignal(number) is _interrupt:  # main's handler, not yet given back
        os.kill(os.getpid(), number)


@command("jdp.train")
def main(argv: Sequence[str] | None = None) -> int:
    if not getattr(sys.unraisablehook, "jdp_interrupts", False):
        sys.unraisablehook = _interrupt_again(sys.unraisablehook)
    previous = {number: signal.signal(number, _interrupt) for number in _SIGNALS}
    try:
        config, first_lines = parse_command(argv)
        # JAX and the rest after the flags: --help and a bad flag answer at once.
        from jdp.distributed.watchdog import EXIT_STALLED
        from jdp.report.console import Console
        from jdp.sample import training_sample
        from jdp.training.limits import what_limited
        from jdp.training.loop import fit

        console = Console()
        for line in first_lines:  # where the settings came from: a recipe's, overridden
            console.first(line)
        # Another process that ends outside training steps ends this one too, at once.
        with Listening(say=lambda line: sys.stderr.write(f"jdp.train: {line}\n")):
            result = fit(config, console=console)
    except _Interrupted as interrupted:
        sys.stderr.write(f"jdp.train: {interrupted} outside training steps; nothing saved\n")
        sys.stdout.flush()
        sys.stderr.flush()
        tell_the_others(str(interrupted))  # in a run of several: they end with this one
        # Interrupted anywhere in start-up, threads (compilation, loading) may be
        # mid-work; waiting for them at exit can abort. Nothing is in flight to keep.
        os._exit(128 + signal.Signals[str(interrupted)].value)
    except UsageError as error:
        sys.stderr.write(f"jdp.train: error: {error}\n")
        return 2
    except (ReplicaMismatchError, NonFiniteError, DataLedgerError, LoaderError) as error:
        sys.stderr.write(f"jdp.train: error: {error}\n")
        return 1
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if (sample := training_sample(config, result)) is not None:
        console.line(sample)
    if (limits := what_limited(config, result)) is not None:
        console.line(limits)
    console.line(result.summary_line())
    # Stopped by a signal (saved where it could be): not a finished run, as a shell's
    # `train && next` must see; 130 for SIGINT, 143 for SIGTERM; a stall's exit code
    # after the watchdog had the state saved (`jdp.distributed.watchdog`).
    if result.stalled:
        return EXIT_STALLED
    return 0 if result.signal is None else 128 + result.signal


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_now(code: int) -> None:
    """Ends the process with ``code`` after the atexit handlers, without waiting for its
    threads: a checkpoint write that failed (a directory made read-only, say) leaves
    Orbax's threads waiting 300 s for signals of the write, and Python's own exit joins
    them first. Every output was closed on the way out of `fit`."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


def _threads_left() -> bool:
    """Whether a thread Python's exit would wait for is still running (a loader's, stuck
    on a worker that stopped, after a signal ended the run)."""
    main_thread = threading.main_thread()
    return any(
        thread.is_alive() and not thread.daemon and thread is not main_thread
        for thread in threading.enumerate()
    )


if __name__ == "__main__":
    code = main()
    if code or _threads_left():
        exit_now(code)
    sys.exit(code)
