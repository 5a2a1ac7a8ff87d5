"""TFDS builders on disk: found by name or taken as given, prepared once, read without TensorFlow.

A catalog dataset is downloaded and prepared as array_record in ``--data-dir``
when the network allows, by one process per directory at a time; what stands in
the way (no network, no TensorFlow, a full disk, a damaged dataset or one
prepared as TFRecord) is one line that says what to do instead. Datasets by name
(`jdp.data.splits.sources`) and your own TFDS builders (`jdp.data.splits.custom`) both read
through here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import os
import socket

import numpy as np

from jdp.data.formats.transforms import Transform
from jdp.errors import UsageError, os_failure
from jdp.report.console import quiet_absl


# Here rather than beside the catalog (`jdp.data.splits.sources.DATASETS`): preparing a
# catalog dataset needs its TFDS name and download host.
@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How jdp reads one dataset: its TFDS name, where it downloads from, its preprocessing."""

    tfds_name: str
    transform: Transform
    download_host: str | None = None  # None: prepared offline from data a package ships


def default_data_dir() -> str:
    """TFDS's own default: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


@contextlib.contextmanager
def quiet():
    """TFDS prints banners, progress bars and log lines (errors still raise); keep runs to
    jdp's own lines."""
    chatter = io.StringIO()
    with quiet_absl(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        yield


def _builder(name: str, data_dir: str):
    import tensorflow_datasets as tfds

    if name == "digits":
        from jdp.data.formats import digits  # noqa: F401  (registers the builder with TFDS)
    # array_record: random access without TensorFlow (TFRecord would need it).
    return tfds.builder(name, data_dir=data_dir, file_format="array_record")


def _reachable(host: str, timeout: float = 3.0) -> bool:
    """A quick probe: TFDS's own download retries for minutes when offline."""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _prepare_command(name: str, data_dir: str) -> str:
    return f"python -m jdp.data prepare {name} --data-dir {data_dir}"


def _has_tensorflow() -> bool:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _prepare_lock(data_dir: str):
    """One preparer per directory: the processes of a run on one host share ``data_dir``."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".jdp-prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_spec(spec: DatasetSpec, name: str, data_dir: str) -> str:
    """``spec``'s dataset prepared in ``data_dir`` (once, under a lock across processes):
    its builder's folder. Unquieted: the caller holds `quiet`."""
    builder = _builder(spec.tfds_name, data_dir)
    if builder.is_prepared():
        return str(builder.data_dir)
    with _prepare_lock(data_dir):
        builder = _builder(spec.tfds_name, data_dir)  # another process may have prepared it
        if builder.is_prepared():
            return str(builder.data_dir)
        return _download_and_prepare(spec, name, data_dir, builder)


def _download_and_prepare(spec: DatasetSpec, name: str, data_dir: str, builder) -> str:
    if spec.download_host:
        elsewhere = (
            f"run `{_prepare_command(name, data_dir)}` where the network reaches it "
            f"(after `pip install tensorflow`) and copy {os.path.join(data_dir, name)} here"
        )
        if not _reachable(spec.download_host):
            raise UsageError(
                f"dataset {name!r} is not prepared in {data_dir} and {spec.download_host} "
                f"cannot be reached; {elsewhere}"
            )
        if not _has_tensorflow():
            raise UsageError(
                f"dataset {name!r} is not prepared in {data_dir}, and TFDS needs TensorFlow to "
                f"prepare it (only to prepare, not to train); `pip install tensorflow` and "
                f"rerun, or {elsewhere}"
            )
    _run_prepare(builder, name, data_dir, "choose another --data-dir")
    return str(builder.data_dir)


def _run_prepare(builder, name: str, data_dir: str, otherwise: str) -> None:
    """``builder.download_and_prepare()``; a full or unwritable disk as one line."""
    try:
        builder.download_and_prepare()
    except (OSError, RuntimeError) as error:
        reason = os_failure(error)
        if reason is None:
            raise
        raise UsageError(
            f"could not prepare dataset {name!r} in {data_dir} ({reason}); free space there, "
            f"or {otherwise}"
        ) from None


def _check_data_dir(data_dir: str | None) -> str:
    if data_dir is not None and not os.path.isdir(data_dir):
        what = "is a file, not a directory" if os.path.exists(data_dir) else "does not exist"
        raise UsageError(
            f"--data-dir {data_dir} {what}; create it, or omit --data-dir to use "
            f"{default_data_dir()}"
        )
    return data_dir or default_data_dir()


def open_builder(name_or_builder, data_dir: str | None, spec: DatasetSpec | None = None):
    """A prepared TFDS builder: by name (prepared here when jdp knows how) or as given.

    A name TFDS does not know is looked up among the datasets already prepared
    in ``data_dir`` (a builder of your own needs no code to be read back).
    """
    with quiet():
        return _open_builder(name_or_builder, data_dir, spec)


def _open_builder(name_or_builder, data_dir: str | None, spec: DatasetSpec | None):
    import tensorflow_datasets as tfds

    if not isinstance(name_or_builder, str):
        builder = name_or_builder
        if not builder.is_prepared():
            _run_prepare(
                builder, builder.name, str(builder.data_dir), "give the builder another data_dir"
            )
        return builder
    name, data_dir = name_or_builder, _check_data_dir(data_dir)
    if spec is not None:
        builder = _builder(spec.tfds_name, data_dir)
        if not builder.is_prepared():
            prepare_spec(spec, name, data_dir)
            builder = _builder(spec.tfds_name, data_dir)
        return builder
    try:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError:
        raise UsageError(
            f"no TFDS dataset {name!r} is known or prepared in {data_dir}; prepare it there "
            "(your builder's download_and_prepare, with file_format='array_record'), or pass "
            "--data-dir"
        ) from None
    if not builder.is_prepared():
        raise UsageError(
            f"TFDS dataset {name!r} is not prepared in {data_dir}; prepare it there as "
            f"array_record (tfds.builder({name!r}, data_dir=..., file_format='array_record')"
            ".download_and_prepare(), which may need TensorFlow) and rerun"
        )
    return builder


def check_readable(builder, split: str) -> None:
    """UsageError for a split the builder lacks, or one prepared in a format that needs
    TensorFlow to read."""
    name, info = builder.name, builder.info
    if split not in info.splits:
        raise UsageError(
            f"dataset {name!r} has no split {split!r}; it has: {', '.join(info.splits)}"
        )
    if info.file_format is None or info.file_format.value != "array_record":
        raise UsageError(
            f"dataset {name!r} in {builder.data_dir} was prepared as {info.file_format}, which "
            "needs TensorFlow to read; prepare it as array_record (file_format='array_record') "
            "into another data directory"
        )


def read_builder_split(builder, split: str) -> tuple[dict[str, np.ndarray], object]:
    """Every example of a prepared builder's ``split``, stacked per numeric feature.

    Returns:
        ``({feature: array}, builder.info)``; string and nested features are left out.
    """
    with quiet():
        return _read_builder_split(builder, split)


# Small splits read in this process: a notebook's second run, or a test's, read digits'
# 1,438 examples again for 60-300 ms of deserializing, where a copy takes microseconds.
# Each caller gets its own copy, as from a read; the copies kept are the cache's own.
# A split is read again when any of its files changed (name, size, inode, times).
_READ: dict[tuple[str, str], tuple[tuple, dict[str, np.ndarray]]] = {}
_READ_KEPT = 4  # splits, each of at most
_READ_BYTES = 32 * 1024 * 1024


def _read_builder_split(builder, split: str) -> tuple[dict[str, np.ndarray], object]:
    check_readable(builder, split)
    key, files = (os.path.realpath(builder.data_dir), split), _files(builder, split)
    kept = _READ.get(key)
    if kept is not None and files is not None and kept[0] == files:
        return {name: array.copy() for name, array in kept[1].items()}, builder.info
    arrays, info = _read_examples(builder, split)
    _READ.pop(key, None)
    if files is not None and sum(array.nbytes for array in arrays.values()) <= _READ_BYTES:
        _READ[key] = (files, {name: array.copy() for name, array in arrays.items()})
        while len(_READ) > _READ_KEPT:
            del _READ[next(iter(_READ))]
    return arrays, info


def _files(builder, split: str) -> tuple | None:
    """What identifies a prepared split's bytes: each of its files' name, size, inode and
    modification and change times (a split prepared again, copied over, or damaged is
    read again); None where they cannot be listed."""
    try:
        with os.scandir(builder.data_dir) as entries:
            stats = [(entry.name, entry.stat()) for entry in entries if f"-{split}." in entry.name]
    except OSError:
        return None
    files = sorted(
        (name, stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns)
        for name, stat in stats
    )
    return tuple(files) or None


def _read_examples(builder, split: str) -> tuple[dict[str, np.ndarray], object]:
    name, info = builder.name, builder.info
    source = builder.as_data_source(split=split)
    try:
        examples = source.__getitems__(range(len(source)))
    except RuntimeError as error:  # array_record's own checksums: "Corrupted Riegeli/records"
        reason = str(error).strip().splitlines()[0][:120]
        raise UsageError(
            f"dataset {name!r} ({split}) in {builder.data_dir} is damaged ({reason}); prepare "
            f"it again: remove {builder.data_dir} and rerun"
        ) from None
    arrays = {}
    for key in info.features:
        values = [np.asarray(example[key]) for example in examples]
        if not values or values[0].dtype.kind not in "biuf":
            continue  # text, bytes and nested features: not model inputs
        if len({value.shape for value in values}) > 1:
            raise UsageError(
                f"feature {key!r} of {name!r} has examples of different shapes; pad or resize "
                "them to one shape when preparing the dataset"
            )
        dtype = getattr(info.features[key], "np_dtype", None)  # a scalar reads as a Python float
        stacked = np.stack(values)
        arrays[key] = stacked.astype(dtype, copy=False) if dtype is not None else stacked
    return arrays, info
