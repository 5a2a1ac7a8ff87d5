"""JAX's persistent compilation cache for a run: a resumed run (or any run of the same
program) reads its compiled train and evaluation steps back instead of compiling them.

``--compile-cache auto`` (the default) keeps the cache in ``CKPT_DIR/compile_cache``
when the run has a checkpoint directory and JAX has no cache directory of yours
(``JAX_COMPILATION_CACHE_DIR``, which then stays in use); ``--compile-cache DIR``
shares one between runs; ``off`` compiles every time. JAX keys each program by its
computation, devices, compiler options and versions, so a changed model, mesh or JAX
compiles anew; only process 0 writes, the others read. An entry that cannot be read is
compiled again (JAX warns). The cache runs code it reads: keep it where only you write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from jdp.errors import UsageError
from jdp.report.bookkeeping import mapping_of, read_or_set_aside
from jdp.report.writers import check_writable

DIRNAME = "compile_cache"  # in the checkpoint directory, with --compile-cache auto

# Programs that compile faster than this are not written. JAX's default, 1 s, leaves
# out the small programs a start runs (the initialisation, the random keys, the
# metrics' reductions), each 0.05-0.5 s on the 2-core development machine; together
# they are about as long as the train step's own compilation. Written from 0.05 s,
# a resume of resnet20 started its first step in 2.9 s against 9.6 s compiling.
MIN_COMPILE_SECONDS = 0.05

_reads = {"programs": 0, "seconds": 0.0}  # from the cache, since the run began


def _count(event: str, *args, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _reads["programs"] += 1


def _count_seconds(event: str, seconds: float, *args, **kwargs) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        _reads["seconds"] += max(0.0, seconds)


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count_seconds)


def reads() -> tuple[int, float]:
    """``(programs, seconds)``: what the run (`compile_cache`'s block) has read from a
    compilation cache so far, and the compile time that saved (as the programs took to
    compile when written)."""
    return _reads["programs"], _reads["seconds"]


def cache_dir(setting: str, ckpt_dir: str | None) -> str | None:
    """The directory ``--compile-cache`` names for a run, or None: no cache of the run's own
    (``off``, or ``auto`` without a checkpoint directory or with a JAX cache of yours).

    Raises:
        UsageError: an empty setting, or a file.
    """
    if setting == "off":
        return None
    if setting == "auto":
        if not ckpt_dir or jax.config.jax_compilation_cache_dir:
            return None
        return os.path.join(ckpt_dir, DIRNAME)
    if not setting.strip():
        raise UsageError("--compile-cache: give a directory, auto (in --ckpt-dir) or off")
    if os.path.exists(setting) and not os.path.isdir(setting):
        raise UsageError(
            f"--compile-cache {setting} is a file, not a directory; name a directory "
            "(it is made if missing) or use --compile-cache off"
        )
    return setting


@contextlib.contextmanager
def compile_cache(setting: str, ckpt_dir: str | None) -> Iterator[None]:
    """JAX's persistent compilation cache as ``--compile-cache`` says, for the block, then
    JAX's own setting again (`cache_dir`; ``off`` turns a cache of yours off too).

    Raises:
        UsageError: the directory cannot be made (for ``auto``: the checkpoint
            directory cannot be written).
    """
    _reads.update(programs=0, seconds=0.0)
    directory = cache_dir(setting, ckpt_dir)
    if directory is None and setting != "off":  # JAX's setting, as it is
        yield
        return
    if setting == "auto":  # the checkpoint directory's own line, before the cache's
        check_writable(ckpt_dir, "--ckpt-dir")
    try:
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--compile-cache: cannot make {directory} ({error.strerror}); name a directory "
            "you can write, or --compile-cache off"
        ) from None
    if directory is not None:
        _drop_changed(directory)
    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    _use(directory, MIN_COMPILE_SECONDS if directory else before[1])
    try:
        yield
    finally:
        _use(*before)
        if directory is not None and jax.process_index() == 0:
            with contextlib.suppress(OSError):  # the record is a check, never a failure
                _record(directory)


# Beside the entries: each one's file (inode, size, mtime) and SHA-256 as jdp last saw it.
ENTRIES = "jdp-entries.json"


def _drop_changed(directory: str) -> None:
    """Removes the entries whose bytes are no longer the ones recorded (swapped with
    another, edited, cut short): JAX would run the program one holds, keyed by its
    name. One warning names them; JAX compiles those programs again. A file only
    moved (another inode, the same bytes) is kept."""
    recorded = read_or_set_aside(os.path.join(directory, ENTRIES), mapping_of(list)) or {}
    changed = []
    for name, value in recorded.items():
        if len(value) != 2 or name != os.path.basename(name) or not name.endswith("-cache"):
            continue  # not jdp's record of an entry
        signature, digest, path = *value, os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if _signature(path) != signature and _digest(path) != digest:
                os.remove(path)
                changed.append(name)
    if changed:
        print(
            f"jdp: warning: {len(changed)} compiled program(s) in {directory} changed since "
            f"a run wrote them ({', '.join(changed[:2])}{', ...' * (len(changed) > 2)}); "
            "removed, to be compiled again",
            file=sys.stderr,
            flush=True,
        )


def _record(directory: str) -> None:
    path = os.path.join(directory, ENTRIES)
    recorded = read_or_set_aside(path, mapping_of(list)) or {}
    entries = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith("-cache"):
            signature = _signature(os.path.join(directory, name))
            known = recorded.get(name)
            same = known is not None and known[0] == signature  # not read again
            entries[name] = [
                signature,
                known[1] if same else _digest(os.path.join(directory, name)),
            ]
    scratch = f"{path}.{os.getpid()}.tmp"  # runs sharing the cache write their own
    with open(scratch, "w") as file:
        json.dump(entries, file)
    os.replace(scratch, path)


def _signature(path: str) -> list[int]:
    stat = os.stat(path)
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns]


def _digest(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _use(directory: str | None, min_seconds: float) -> None:
    # JAX opens its cache once, at the first compilation after the directory is set:
    # another directory needs the open one reset.
    if jax.config.jax_compilation_cache_dir != directory:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
