"""Every ``python -m jdp.*`` tool meets generic bad paths (missing, a loop of links, a
directory where a file belongs and the reverse, empty, cut short, unwritable, a name that
is not UTF-8) with one line and exit code 2 (1 for a fault while working), never a Python
traceback. Each tool's ``main`` runs in this process, its output written through real
UTF-8 text streams, as a terminal's are (`tools.tool_faults`, whose table of the
tools' path arguments this walks; the faults benchmark draws from it at random)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jdp.tool import os_line, read_json
from tools.tool_faults import SLOTS, answered, arguments, bad_paths, make_inputs, run_main


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("sound"))


@pytest.mark.parametrize("slot", SLOTS)
def test_a_tool_meets_bad_paths_with_one_line(made, tmp_path, slot):
    module, _, kind, sound, sound_there = SLOTS[slot]
    failed = []
    for what, path in bad_paths(made, tmp_path, kind, sound).items():
        if what in sound_there:
            continue
        code, err = run_main(module, *arguments(made, tmp_path, slot, path))
        if not answered(code, err):
            failed.append(f"{what} ({path}): exit {code!r}\n{err}")
    assert not failed, "\n\n".join(failed)


def test_an_os_error_is_a_line_naming_the_path_and_the_fix():
    full = OSError(errno.ENOSPC, "No space left on device", "/data/x")
    assert os_line(full) == (
        "/data/x: No space left on device; free space there and run it again",
        1,
    )
    odd = FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(b"/d/\xff"))
    assert os_line(odd) == (r"/d/\xff: No such file or directory; give a path that exists", 2)


def test_a_json_file_is_read_or_named_with_what_is_wrong(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"n_layer": 2,')
    with pytest.raises(
        Exception,
        match=r"config.json is not a GPT-2 config: not JSON \(.* at "
        r"line 1, column 15\); give one",
    ):
        read_json(path, "a GPT-2 config", "give one")


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny GPT-2 directory as ``save_pretrained`` writes it (jdp's own writer: no torch)."""
    import jax
    import jax.numpy as jnp
    from flax.core import meta

    from jdp.models.hf import write_hf
    from jdp.models.transformer import GPT

    gpt = GPT(vocab_size=40, width=16, heads=2, layers=2, hidden=32, max_len=8)
    params = meta.unbox(jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    directory = tmp_path_factory.mktemp("gpt2")
    write_hf(directory, gpt, jax.tree.map(np.asarray, params["params"]))
    return directory


def test_a_full_disk_while_writing_gpt2_weights_is_the_os_error_naming_the_file(
    tmp_path, monkeypatch
):
    """safetensors reports the OS's failure in its own error type: jdp turns it back into
    the OSError (the tools' one line: path, reason, fix) and leaves no file cut short."""
    import jax
    import jax.numpy as jnp
    import safetensors.numpy
    from flax.core import meta

    from jdp.models.hf import WEIGHTS_FILE, write_hf
    from jdp.models.transformer import GPT
    from jdp.tool import os_line

    def full(tensors, path, metadata=None):
        open(path, "wb").close()  # what was written before the disk filled
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    gpt = GPT(vocab_size=40, width=16, heads=2, layers=2, hidden=32, max_len=8)
    params = meta.unbox(jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    with pytest.raises(OSError) as raised:
        write_hf(tmp_path, gpt, jax.tree.map(np.asarray, params["params"]))
    line, code = os_line(raised.value)
    assert code == 1 and line == (
        f"{tmp_path / WEIGHTS_FILE}: No space left on device; free space there and run it again"
    )
    assert not (tmp_path / WEIGHTS_FILE).exists()


def _changed_config(config):
    return [
        ({**config, "n_head": 3}, "n_head 3 does not divide n_embd 16"),
        ({**config, "n_layer": -1}, "n_layer -1 is not a positive whole number"),
        ({**config, "n_embd": True}, "n_embd True is not a positive whole number"),
        ({**config, "layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon '1e-5' is not a number"),
        ({**config, "resid_pdrop": 1.5}, "resid_pdrop 1.5 is not a number in [0, 1)"),
        ([config], "is not a GPT-2 config.json: not a JSON object"),
    ]


def _changed_tensors(tensors):
    wte = tensors["wte.weight"]
    return [
        ({**tensors, "wte.weight": wte.astype(np.int32)}, "wte.weight holds int32 numbers"),
        (
            {**tensors, "wte.weight": np.where(wte > 0, np.nan, wte).astype(wte.dtype)},
            "the tensor wte.weight holds NaN or infinite numbers",
        ),
    ]


def test_hugging_face_files_no_gpt2_has_are_one_line(gpt2_files, tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    from jdp.errors import UsageError
    from jdp.models.hf import from_hf

    config = json.loads((gpt2_files / "config.json").read_text())
    tensors = {
        name.removeprefix("transformer."): value
        for name, value in load_file(gpt2_files / "model.safetensors").items()
    }
    index = {"weight_map": {name: "model.safetensors" for name in tensors}}
    cases = [(c, tensors, None, needle) for c, needle in _changed_config(config)]
    cases += [(config, t, None, needle) for t, needle in _changed_tensors(tensors)]
    cases += [
        (config, tensors, "{", "is not a safetensors index: not JSON"),
        (config, tensors, {"weight_map": 3}, "weight_map is not tensor names to file"),
        (config, tensors, {}, "is not a safetensors index: it has no 'weight_map'"),
        (config, tensors, index, None),
    ]
    for number, (config_, tensors_, index_, needle) in enumerate(cases):
        directory = tmp_path / str(number)
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config_))
        save_file(tensors_, directory / "model.safetensors")
        if index_ is not None:
            text = index_ if isinstance(index_, str) else json.dumps(index_)
            (directory / "model.safetensors.index.json").write_text(text)
        if needle is None:  # the sound sharded form reads
            assert from_hf(directory).module.layers == 2
            continue
        with pytest.raises(UsageError) as error:
            from_hf(directory)
        assert needle in str(error.value) and "\n" not in str(error.value), (needle, error.value)


@pytest.mark.parametrize(
    ("module", "argv", "needle"),
    [
        (
            "jdp.train",
            ["--dataset", "images:IMAGES", "--image-size", "100000,100000"],
            "--image-size 100000,100000: a process's 128 such crops of a batch are 3,576.3 GiB",
        ),
        (
            "jdp.data",
            ["pack", "IMAGES", "--out", "OUT", "--shard-mb", "nan"],
            "--shard-mb nan: give a size above 0",
        ),
        (
            "jdp.data",
            ["tokenize", "TEXT", "--out", "OUT", "--workers", "-1"],
            "--workers -1: give 0 or 1 (this process) or more",
        ),
        ("jdp.replay", ["LOGS", "--step", "1", "--top", "-1"], "--top -1: give how many"),
        ("jdp.bench", ["scaling", "--steps", "-5"], "--steps -5: give 1 or more"),
        ("jdp.bench", ["step", "--rounds", "0"], "--rounds 0: give 1 or more"),
        ("jdp.bench", ["dispatch", "--steps-per-call", "4,x"], "--steps-per-call '4,x': give"),
        ("jdp.bench", ["diloco", "--sync-every", "0"], "--sync-every '0': give whole numbers"),
        ("jdp.bench", ["memory", "--loss-chunks", "0"], "--loss-chunks 0: give 1 or more"),
        ("jdp.bench", ["memory", "--meshes", "data=3"], "batch 8 is not divisible by the data"),
        ("jdp.bench", ["corpus", "--gigabytes", "0"], "--gigabytes 0.0: give more than 0"),
        ("tools.faults", ["--kills", "-1"], "--kills -1: give 0 or more"),
    ],
)
def test_numbers_out_of_range_are_one_line_before_any_work(made, tmp_path, module, argv, needle):
    named = {
        "IMAGES": made / "images",
        "TEXT": made / "text",
        "LOGS": made / "logs",
        "OUT": tmp_path / "out",
    }
    code, err = run_main(module, *[named.get(arg, arg) for arg in argv])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_flags_limit_on_pixels_is_the_decoders():
    from PIL import Image

    from jdp.training.config_checks import MAX_PIXELS

    assert MAX_PIXELS == 2 * Image.MAX_IMAGE_PIXELS


def test_a_tools_output_outlives_its_reader():
    """A launcher killed with -9 leaves its workers' output pipes without a reader: a
    line written then is dropped, not a `BrokenPipeError` that ends the run unsaved."""
    from jdp.tool import _Survivor

    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stream:
        survivor = _Survivor(stream)
        for line in ("step 60/600\n", "step 120/600\n"):
            assert survivor.write(line) == len(line)
            survivor.flush()
        assert survivor.writable() and survivor.fileno() == write
