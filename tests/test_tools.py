"""Every ``python -m jdp.*`` tool meets generic bad paths (missing, a loop of links, a
directory where a file belongs and the reverse, empty, cut short, unwritable, a name that
is not UTF-8) with one line and exit code 2 (1 for a fault while working), never a Python
traceback. Each tool's ``main`` runs in this process, its output written through real
UTF-8 text streams, as a terminal's are (`_run`)."""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import os
import shutil
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jdp.tool import os_line, read_json

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--mesh", "data=1", "--steps", "1", "--warmup-steps", "0"]


def _run(module: str, *argv) -> tuple[object, str]:
    """``main(argv)`` of a tool: its exit code (the exception's text when one escaped) and
    stderr. stdout is strict UTF-8 and stderr escapes, as Python's own streams are."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace",
                           write_through=True)  # fmt: skip
    main = importlib.import_module(module).main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():  # fmt: skip
        warnings.simplefilter("ignore")
        try:
            code = main([os.fspath(arg) for arg in argv])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # what reached the user is the point
            code = traceback.format_exc()
    return code, err.buffer.getvalue().decode("utf-8", "replace")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Sound inputs of every kind the tools read: text, a token corpus, a gpt's
    checkpoints and log, its Hugging Face export, a class-folder image tree, an .npz and a
    recipe."""
    root = tmp_path_factory.mktemp("sound")
    text = root / "text"
    text.mkdir()
    (text / "a.txt").write_text("one two three four five six seven eight nine. " * 40)
    (text / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert _run("jdp.data.__main__", "tokenize", text, "--out", root / "corpus", "--workers",
                "1", "--val-fraction", "0.3")[0] == 0  # fmt: skip
    trained = _run("jdp.train", *TRAIN, "--model", "gpt", "--model-size", "small", "--dataset",
                   f"tokens:{root / 'corpus'}", "--seq-len", "16", "--batch-size", "8",
                   "--ckpt-dir", root / "ckpt", "--log-dir", root / "logs")  # fmt: skip
    assert trained[0] == 0, trained[1]
    assert _run("jdp.export", root / "ckpt", "--to", "hf", root / "hf")[0] == 0
    for split in ("train", "test"):
        for name in ("cat", "dog"):
            (root / "images" / split / name).mkdir(parents=True)
            for shade in range(2):
                image = np.full((8, 8, 3), 60 * shade, np.uint8)
                Image.fromarray(image).save(root / "images" / split / name / f"{shade}.png")
    np.savez(root / "arrays.npz", x_train=np.ones((16, 4), "f4"), y_train=np.arange(16) % 2)
    shutil.copy(ROOT / "jdp/recipes/digits-mlp.toml", root / "recipe.toml")
    return root


def _bad(made, tmp_path, kind: str, sound: str | None) -> dict[str, Path]:
    """The generic bad paths for a slot of ``kind`` (in_file, in_dir, out_dir,
    out_file), beside a copy of the ``sound`` input under a name that is not UTF-8."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    a_dir, a_file = tmp_path / "a-dir", tmp_path / "a-file"
    a_dir.mkdir()
    a_file.write_text("not what was asked for\n")
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/n\xffme"))  # Latin-1's "ÿ"
    if sound and kind.startswith("in"):
        (shutil.copytree if (made / sound).is_dir() else shutil.copy)(made / sound, odd)
    bad = {"a loop of links": loop, "not UTF-8": odd}
    if kind.startswith("in"):  # a new path is what an output is
        bad["missing"] = tmp_path / "missing"
    if kind == "in_file":
        whole = (made / sound).read_bytes()
        (tmp_path / "cut").write_bytes(whole[: len(whole) // 2])
        (tmp_path / "empty").write_bytes(b"")
        bad |= {"a directory": a_dir, "empty": tmp_path / "empty", "cut short": tmp_path / "cut"}
    elif kind == "in_dir":
        bad |= {"a file": a_file, "empty": a_dir}
    elif kind == "out_dir":
        bad |= {"a file": a_file, "unwritable": "/proc/jdp-out", "under a file": a_file / "x"}
    else:
        bad |= {"unwritable": "/proc/jdp-out/x.png", "under a file": a_file / "x.png"}
    return bad


# (tool, argv with {} where the bad path goes, slot kind, the sound input, kinds of bad
# input that are sound there and finish with 0: why).
SLOTS = {
    "train --dataset npz:": ("jdp.train", [*TRAIN, "--dataset", "npz:{}"], "in_file",
                             "arrays.npz", {}),
    "train --dataset tokens:": ("jdp.train", [*TRAIN, "--model", "gpt", "--seq-len", "16",
                                "--dataset", "tokens:{}"], "in_dir", "corpus", {}),
    "train --dataset images:": ("jdp.train", [*TRAIN, "--dataset", "images:{}",
                                "--image-size", "8,8"], "in_dir", "images", {}),
    "train --recipe": ("jdp.train", [*TRAIN, "--recipe", "{}"], "in_file", "recipe.toml", {}),
    "train --ckpt-dir": ("jdp.train", [*TRAIN, "--ckpt-dir", "{}"], "out_dir", None, {}),
    "train --log-dir": ("jdp.train", [*TRAIN, "--log-dir", "{}"], "out_dir", None, {}),
    "train --init-from hf:": ("jdp.train", [*TRAIN, "--model", "gpt", "--seq-len", "16",
                              "--dataset", "tokens:CORPUS", "--init-from", "hf:{}"],
                              "in_dir", "hf", {}),
    "data tokenize FILE": ("jdp.data.__main__", ["tokenize", "{}", "--out", "OUT", "--workers",
                           "1"], "in_file", "text/a.txt", {"cut short": "half a text is text"}),
    "data tokenize --out": ("jdp.data.__main__", ["tokenize", "TEXT", "--out", "{}",
                            "--workers", "1"], "out_dir", None, {}),
    "data tokenize --tokenizer": ("jdp.data.__main__", ["tokenize", "TEXT", "--out", "OUT",
                                  "--tokenizer", "{}"], "in_file", "text/a.txt", {}),
    "data pack FOLDER": ("jdp.data.__main__", ["pack", "{}", "--out", "OUT"], "in_dir",
                         "images", {}),
    "data pack --out": ("jdp.data.__main__", ["pack", "IMAGES", "--out", "{}"], "out_dir",
                        None, {}),
    "data prepare --data-dir": ("jdp.data.__main__", ["prepare", "digits", "--data-dir", "{}"],
                                "out_dir", None, {}),
    "export CKPT_DIR": ("jdp.export", ["{}", "--to", "hf", "OUT"], "in_dir", "ckpt", {}),
    "export OUT": ("jdp.export", ["CKPT", "--to", "hf", "{}"], "out_dir", None, {}),
    "sample CKPT_DIR": ("jdp.sample", ["{}", "--prompt", "one", "--max-new-tokens", "2"],
                        "in_dir", "ckpt", {}),
    "sample --tokenizer": ("jdp.sample", ["CKPT", "--prompt", "one", "--tokenizer", "{}"],
                           "in_file", "text/a.txt", {}),
    "replay RUN_DIR": ("jdp.replay", ["{}", "--step", "1", "--out", "OUT"], "in_dir", "logs",
                       {}),
    "replay --ckpt-dir": ("jdp.replay", ["LOGS", "--step", "1", "--ckpt-dir", "{}", "--out",
                          "OUT"], "in_dir", "ckpt",
                          {"empty": "no checkpoint: the run's steps are computed from its start"}),
    "replay --out": ("jdp.replay", ["LOGS", "--step", "1", "--out", "{}"], "out_dir", None, {}),
    "plot RUN_DIR": ("jdp.plot", ["{}", "--out", "OUT/c.png"], "in_dir", "logs", {}),
    "plot --out": ("jdp.plot", ["LOGS", "--out", "{}"], "out_file", None,
                   {"a loop of links": "matplotlib adds .png: it writes loop.png"}),
    "launch COMMAND": ("jdp.launch", ["--nproc", "1", "--", "{}"], "in_file", "text/a.txt",
                       {}),
    "bench.gpu_docs JSON": ("jdp.bench.gpu_docs", ["{}", "--check"], "in_file",
                            "gpu.json", {}),
}  # fmt: skip


@pytest.mark.parametrize("slot", SLOTS)
def test_a_tool_meets_bad_paths_with_one_line(made, tmp_path, slot):
    module, argv, kind, sound, sound_there = SLOTS[slot]
    if sound == "gpu.json" and not (made / sound).exists():
        shutil.copy(sorted((ROOT / "docs/gpu").glob("*.json"))[0], made / sound)
    named = {"CORPUS": made / "corpus", "TEXT": made / "text", "IMAGES": made / "images",
             "CKPT": made / "ckpt", "LOGS": made / "logs", "OUT": tmp_path / "out"}  # fmt: skip
    failed = []
    for what, path in _bad(made, tmp_path, kind, sound).items():
        if what in sound_there:
            continue
        args = []
        for arg in argv:  # the sound inputs' places first, then the bad path's
            for name, sound_path in named.items():
                arg = arg.replace(name, os.fspath(sound_path))
            args.append(arg.replace("{}", os.fspath(path)))
        code, err = _run(module, *args)
        # argparse's answer to a flag is its usage, then the line: the usage is not counted
        lines = [line for line in err.strip().splitlines()
                 if not line.startswith(("usage:", " "))]  # fmt: skip
        if code not in (1, 2) or "Traceback" in err or len(lines) != 1:
            failed.append(f"{what} ({path}): exit {code!r}\n{err}")
    assert not failed, "\n\n".join(failed)


def test_an_os_error_is_a_line_naming_the_path_and_the_fix():
    full = OSError(errno.ENOSPC, "No space left on device", "/data/x")
    assert os_line(full) == ("/data/x: No space left on device; free space there and run it "
                             "again", 1)  # fmt: skip
    odd = FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(b"/d/\xff"))
    assert os_line(odd) == (r"/d/\xff: No such file or directory; give a path that exists", 2)


def test_a_json_file_is_read_or_named_with_what_is_wrong(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"n_layer": 2,')
    with pytest.raises(Exception, match=r"config.json is not a GPT-2 config: not JSON \(.* at "
                       r"line 1, column 15\); give one"):  # fmt: skip
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
        ({**tensors, "wte.weight": np.where(wte > 0, np.nan, wte).astype(wte.dtype)},
         "the tensor wte.weight holds NaN or infinite numbers"),
    ]  # fmt: skip


def test_hugging_face_files_no_gpt2_has_are_one_line(gpt2_files, tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    from jdp.errors import UsageError
    from jdp.models.hf import from_hf

    config = json.loads((gpt2_files / "config.json").read_text())
    tensors = {name.removeprefix("transformer."): value
               for name, value in load_file(gpt2_files / "model.safetensors").items()}  # fmt: skip
    index = {"weight_map": {name: "model.safetensors" for name in tensors}}
    cases = [(c, tensors, None, needle) for c, needle in _changed_config(config)]
    cases += [(config, t, None, needle) for t, needle in _changed_tensors(tensors)]
    cases += [(config, tensors, "{", "is not a safetensors index: not JSON"),
              (config, tensors, {"weight_map": 3}, "weight_map is not tensor names to file"),
              (config, tensors, {}, "is not a safetensors index: it has no 'weight_map'"),
              (config, tensors, index, None)]  # fmt: skip
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
        ("jdp.train", ["--dataset", "images:IMAGES", "--image-size", "100000,100000"],
         "--image-size 100000,100000: a process's 128 such crops of a batch are 3,576.3 GiB"),
        ("jdp.data.__main__", ["pack", "IMAGES", "--out", "OUT", "--shard-mb", "nan"],
         "--shard-mb nan: give a size above 0"),
        ("jdp.data.__main__", ["tokenize", "TEXT", "--out", "OUT", "--workers", "-1"],
         "--workers -1: give 0 or 1 (this process) or more"),
        ("jdp.replay", ["LOGS", "--step", "1", "--top", "-1"], "--top -1: give how many"),
    ],
)  # fmt: skip
def test_numbers_out_of_range_are_one_line_before_any_work(made, tmp_path, module, argv, needle):
    named = {"IMAGES": made / "images", "TEXT": made / "text", "LOGS": made / "logs",
             "OUT": tmp_path / "out"}  # fmt: skip
    code, err = _run(module, *[named.get(arg, arg) for arg in argv])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_flags_limit_on_pixels_is_the_decoders():
    from jdp.data.images import MAX_PIXELS
    from jdp.training.config_checks import MAX_PIXELS as FLAGS_MAX_PIXELS

    assert FLAGS_MAX_PIXELS == MAX_PIXELS
