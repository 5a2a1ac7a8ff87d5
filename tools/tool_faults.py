"""Bad input to every tool, a class of ``python -m tools.faults`` and the table the
suite walks: each ``python -m jdp.*`` tool's path arguments (`SLOTS`) given generic bad
paths (`bad_paths`: missing, a loop of links, a directory where a file belongs and the
reverse, empty, cut short, unwritable, a name that is not UTF-8). A tool must answer in
one line with exit code 2 (1 for a fault met while working), never a Python traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parents[1] / "jdp" / "recipes"
TRAIN = ["--mesh", "data=1", "--steps", "1", "--warmup-steps", "0"]
_GPT = ["--model", "gpt", "--seq-len", "16"]

# Each tool's path arguments: the tool, its arguments with {} where the bad path goes
# (CORPUS, TEXT, IMAGES, CKPT, LOGS: the sound inputs; OUT: a new directory), the kind of
# path (in_file, in_dir, out_dir, out_file), the sound input it stands for, and the bad
# paths that are sound there and finish with 0 (why).
SLOTS = {
    "train --dataset npz:": (
        "jdp.train",
        [*TRAIN, "--dataset", "npz:{}"],
        "in_file",
        "arrays.npz",
        {},
    ),
    "train --dataset tokens:": (
        "jdp.train",
        [*TRAIN, *_GPT, "--dataset", "tokens:{}"],
        "in_dir",
        "corpus",
        {},
    ),
    "train --dataset images:": (
        "jdp.train",
        [*TRAIN, "--dataset", "images:{}", "--image-size", "8,8"],
        "in_dir",
        "images",
        {},
    ),
    "train --recipe": ("jdp.train", [*TRAIN, "--recipe", "{}"], "in_file", "recipe.toml", {}),
    "train --ckpt-dir": ("jdp.train", [*TRAIN, "--ckpt-dir", "{}"], "out_dir", None, {}),
    "train --log-dir": ("jdp.train", [*TRAIN, "--log-dir", "{}"], "out_dir", None, {}),
    "train --init-from hf:": (
        "jdp.train",
        [*TRAIN, *_GPT, *"--dataset tokens:CORPUS --init-from".split(), "hf:{}"],
        "in_dir",
        "hf",
        {},
    ),
    "data tokenize FILE": (
        "jdp.data",
        ["tokenize", "{}", *"--out OUT --workers 1".split()],
        "in_file",
        "text/a.txt",
        {"cut short": "half a text is text"},
    ),
    "data tokenize --out": (
        "jdp.data",
        [*"tokenize TEXT --out".split(), "{}", "--workers", "1"],
        "out_dir",
        None,
        {},
    ),
    "data tokenize --tokenizer": (
        "jdp.data",
        [*"tokenize TEXT --out OUT --tokenizer".split(), "{}"],
        "in_file",
        "text/a.txt",
        {},
    ),
    "data pack FOLDER": ("jdp.data", ["pack", "{}", "--out", "OUT"], "in_dir", "images", {}),
    "data pack --out": ("jdp.data", ["pack", "IMAGES", "--out", "{}"], "out_dir", None, {}),
    "data prepare --data-dir": (
        "jdp.data",
        ["prepare", "digits", "--data-dir", "{}"],
        "out_dir",
        None,
        {},
    ),
    "export CKPT_DIR": ("jdp.export", ["{}", "--to", "hf", "OUT"], "in_dir", "ckpt", {}),
    "export OUT": ("jdp.export", ["CKPT", "--to", "hf", "{}"], "out_dir", None, {}),
    "sample CKPT_DIR": (
        "jdp.sample",
        ["{}", "--prompt", "one", "--max-new-tokens", "2"],
        "in_dir",
        "ckpt",
        {},
    ),
    "sample --tokenizer": (
        "jdp.sample",
        ["CKPT", "--prompt", "one", "--tokenizer", "{}"],
        "in_file",
        "text/a.txt",
        {},
    ),
    "replay RUN_DIR": ("jdp.replay", ["{}", "--step", "1", "--out", "OUT"], "in_dir", "logs", {}),
    "replay --ckpt-dir": (
        "jdp.replay",
        [*"LOGS --step 1 --ckpt-dir".split(), "{}", "--out", "OUT"],
        "in_dir",
        "ckpt",
        {"empty": "no checkpoint: the run's steps are computed from its start"},
    ),
    "replay --out": ("jdp.replay", ["LOGS", "--step", "1", "--out", "{}"], "out_dir", None, {}),
    "plot RUN_DIR": ("jdp.plot", ["{}", "--out", "OUT/c.png"], "in_dir", "logs", {}),
    "plot --out": (
        "jdp.plot",
        ["LOGS", "--out", "{}"],
        "out_file",
        None,
        {"a loop of links": "matplotlib adds .png: it writes loop.png"},
    ),
    "launch COMMAND": ("jdp.launch", ["--nproc", "1", "--", "{}"], "in_file", "text/a.txt", {}),
    "tools.gpu_docs JSON": ("tools.gpu_docs", ["{}", "--check"], "in_file", "gpu.json", {}),
}


def run_main(module: str, *argv) -> tuple[object, str]:
    """A tool's ``main(argv)`` in this process: its exit code (the traceback's text when an
    exception escaped) and stderr. stdout is strict UTF-8 and stderr escapes, as Python's
    own streams are, so a name a terminal cannot show fails here as it would there."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(
        io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    named = f"{module}.__main__" if module in ("jdp.data", "jdp.bench") else module
    main = importlib.import_module(named).main
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        try:
            code = main([os.fspath(arg) for arg in argv])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # what would reach the user is the point
            code = traceback.format_exc()
    return code, err.buffer.getvalue().decode("utf-8", "replace")


def make_inputs(root: Path) -> Path:
    """Sound inputs of every kind the tools read, in ``root``: text, a token corpus, a gpt's
    checkpoints and log, its Hugging Face export, a class-folder image tree, an .npz, a
    recipe and a JSON of ``jdp.bench gpu``'s shape. Runs the tools in this process."""
    from PIL import Image

    text = root / "text"
    text.mkdir(parents=True)
    (text / "a.txt").write_text("one two three four five six seven eight nine. " * 40)
    (text / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.loop import fit

    # No validation split and a gpt of one narrow layer: the fewest programs to compile.
    corpus, ckpt = root / "corpus", root / "ckpt"
    code, err = run_main(
        "jdp.data", "tokenize", text, "--out", corpus, *"--workers 1 --val-fraction 0".split()
    )
    if code != 0:
        raise RuntimeError(f"jdp.data tokenize could not make a sound input: {err}")
    config = TrainConfig(
        mesh="data=1",
        steps=1,
        warmup_steps=0,
        model="gpt",
        layers=1,
        width=16,
        heads=2,
        dataset=f"tokens:{corpus}",
        seq_len=16,
        batch_size=8,
        ckpt_dir=str(ckpt),
        log_dir=str(root / "logs"),
        compile_cache="off",
    )
    with contextlib.redirect_stdout(io.StringIO()):
        fit(config, console=Console(enabled=False))
    code, err = run_main("jdp.export", ckpt, "--to", "hf", root / "hf")
    if code != 0:
        raise RuntimeError(f"jdp.export could not make a sound input: {err}")
    for split in ("train", "test"):
        for name in ("cat", "dog"):
            (root / "images" / split / name).mkdir(parents=True)
            for shade in range(2):
                image = np.full((8, 8, 3), 60 * shade, np.uint8)
                Image.fromarray(image).save(root / "images" / split / name / f"{shade}.png")
    np.savez(root / "arrays.npz", x_train=np.ones((16, 4), "f4"), y_train=np.arange(16) % 2)
    shutil.copy(RECIPES / "digits-mlp.toml", root / "recipe.toml")
    (root / "gpu.json").write_text(json.dumps({"date": "-", "command": "-", "parts": {}}))
    return root


def bad_paths(made: Path, where: Path, kind: str, sound: str | None) -> dict[str, Path]:
    """The generic bad paths for a path argument of ``kind``, made in ``where``, beside a
    copy of the ``sound`` input (in ``made``) under a name that is not UTF-8."""
    loop = where / "loop"
    loop.symlink_to(loop)
    a_dir, a_file = where / "a-dir", where / "a-file"
    a_dir.mkdir()
    a_file.write_text("not what was asked for\n")
    odd = Path(os.fsdecode(os.fsencode(where) + b"/n\xffme"))  # Latin-1's "ÿ"
    if sound and kind.startswith("in"):
        (shutil.copytree if (made / sound).is_dir() else shutil.copy)(made / sound, odd)
    bad = {"a loop of links": loop, "not UTF-8": odd}
    if kind.startswith("in"):  # a new path is what an output is
        bad["missing"] = where / "missing"
    if kind == "in_file":
        whole = (made / sound).read_bytes()
        (where / "cut").write_bytes(whole[: len(whole) // 2])
        (where / "empty").write_bytes(b"")
        bad |= {"a directory": a_dir, "empty": where / "empty", "cut short": where / "cut"}
    elif kind == "in_dir":
        bad |= {"a file": a_file, "empty": a_dir}
    elif kind == "out_dir":
        bad |= {"a file": a_file, "unwritable": Path("/proc/jdp-out"), "under a file": a_file / "x"}
    else:
        os.mkfifo(where / "fifo.png")  # written into, it would block; renamed over, replaced
        (where / "device.png").symlink_to("/dev/null")
        bad |= {
            "unwritable": Path("/proc/jdp-out/x.png"),
            "under a file": a_file / "x.png",
            "a FIFO": where / "fifo.png",
            "a link to a device": where / "device.png",
        }
    return bad


def arguments(made: Path, where: Path, slot: str, path: Path) -> list[str]:
    """``SLOTS[slot]``'s arguments with the sound inputs, a new output in ``where`` and
    ``path`` in the bad path's place."""
    named = {
        "CORPUS": made / "corpus",
        "TEXT": made / "text",
        "IMAGES": made / "images",
        "CKPT": made / "ckpt",
        "LOGS": made / "logs",
        "OUT": where / "out",
    }
    args = []
    for arg in SLOTS[slot][1]:  # the sound inputs' places first, then the bad path's
        for name, sound_path in named.items():
            arg = arg.replace(name, os.fspath(sound_path))
        args.append(arg.replace("{}", os.fspath(path)))
    return args


def answered(code: object, err: str) -> bool:
    """Exit 1 or 2 and one line, no traceback (argparse's usage before a flag's line is
    not counted)."""
    lines = [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))]
    return code in (1, 2) and "Traceback" not in err and len(lines) == 1


def tool_faults(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """Random tools' path arguments given random bad paths, each in a fresh process as a
    user runs it: "one line" (exit 2 or 1), "traceback", or "other" (another exit code
    or more lines)."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-tool-faults-") as root:
        made = make_inputs(Path(root) / "sound")
        for trial in range(trials):
            where = Path(root) / f"trial-{trial}"
            where.mkdir()
            slot = rng.choice(sorted(SLOTS))
            module, _, kind, sound, sound_there = SLOTS[slot]
            bad = {
                k: v for k, v in bad_paths(made, where, kind, sound).items() if k not in sound_there
            }
            what = rng.choice(sorted(bad))
            done = subprocess.run(
                [sys.executable, "-m", module, *arguments(made, where, slot, bad[what])],
                capture_output=True,
                text=True,
                errors="backslashreplace",
                timeout=300,
            )
            verdict = (
                "one line"
                if answered(done.returncode, done.stderr)
                else "traceback"
                if "Traceback" in done.stderr
                else "other"
            )
            outcomes[verdict] += 1
            emit(f"  {slot} given {what}: {verdict}")
    return outcomes
