"""Where streamed images come from: a class-folder tree of any size, its packed form, or
a prepared TFDS dataset of images of many sizes (``imagenet2012``, ``imagenette``).

`from_images` opens a tree or a pack as an `jdp.data.formats.images.ImageSplit` (nothing
decoded, nothing read but the names), `from_tfds_images` a TFDS split; `pack`
writes a tree's encoded images, unchanged and in the same order, into a few
array_record files (``python -m jdp.data pack``), so a cluster's hosts read a few
large files rather than a million small ones. A packed split is a folder of
``images-NNNNN.array_record`` shards, ``labels.npy``
and ``images.json`` (its classes, count and shards), written last: a folder
without it is not a packed split.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from jdp.data.formats.builders import check_readable, open_builder
from jdp.data.formats.images import (
    IMAGE_SUFFIXES,
    PACKED_META,
    FileStore,
    ImageSplit,
    ImageTransform,
    PackedStore,
    TfdsStore,
    why_unreadable,
)
from jdp.data.formats.images import image_size as header_size
from jdp.errors import UsageError, not_there
from jdp.tool import shown

FORMAT = "jdp-packed-images"
SPLITS = ("train", "validation", "test")


def from_images(
    path: str | os.PathLike,
    *,
    image_size: tuple[int, int] = (224, 224),
    classes: tuple[str, ...] | None = None,
    transform: ImageTransform | None = None,
) -> ImageSplit:
    """The images under ``path`` streamed: a folder with one subfolder per class (class
    ``i`` the ``i``-th in sorted order, or in ``classes``), or a split `pack` wrote.

    Images of any size and format Pillow reads; ``image_size`` is the crops' ``(height,
    width)`` (``transform`` sets the rest, `ImageTransform`).

    Raises:
        UsageError: a missing folder, no class folders, a class folder without images,
            or a packed split of other classes than ``classes``.
    """
    root = os.fspath(path)
    transform = transform or ImageTransform(size=tuple(image_size))
    meta_path = os.path.join(root, PACKED_META)
    if os.path.isfile(meta_path):
        meta = _meta(meta_path)
        found = tuple(meta["classes"])
        if classes is not None and tuple(classes) != found:
            raise UsageError(
                f"{root} was packed with other classes than the training split's; "
                "pack every split of one tree together (python -m jdp.data pack)"
            )
        store = PackedStore([os.path.join(root, shard) for shard in meta["shards"]])
        labels = np.load(os.path.join(root, "labels.npy")).astype(np.int32)
        if len(labels) != len(store) or len(labels) != meta["count"]:
            raise UsageError(
                f"{root} holds {len(store)} images and {len(labels)} labels, "
                f"not the {meta['count']} it was packed with; pack it again"
            )
        if len(labels) and not 0 <= labels.min() <= labels.max() < len(found):
            raise UsageError(
                f"{root}'s labels.npy holds labels outside its {len(found)} "
                "classes; pack the images again"
            )
        return ImageSplit(store, labels, len(found), transform, found)
    files, labels, classes = _tree(root, classes)
    names = [file[len(root) :].lstrip(os.sep) for file in files]
    return ImageSplit(
        FileStore(root, names), np.asarray(labels, np.int32), len(classes), transform, classes
    )


def from_tfds_images(
    name_or_builder,
    split: str = "train",
    *,
    data_dir: str | None = None,
    image_size: tuple[int, int] = (224, 224),
    transform: ImageTransform | None = None,
) -> ImageSplit:
    """A prepared TFDS dataset's images streamed: its image feature's encoded bytes read
    per batch (never decoded by TFDS, never all in memory), its class label with them.

    ``name_or_builder`` as `jdp.data.from_tfds` takes it; ImageNet is
    ``imagenet2012``, prepared once from its manual download (TFDS's ``manual_dir``).

    Raises:
        UsageError: a dataset that is not prepared, a split it lacks, or one without
            an image feature and a class label.
    """
    builder = open_builder(name_or_builder, data_dir)
    check_readable(builder, split)
    features = builder.info.features
    image_key = streamed_image_key(features)
    labels = [key for key in features if type(features[key]).__name__ == "ClassLabel"]
    if image_key is None or len(labels) != 1:
        raise UsageError(
            f"{builder.name} is not a dataset of images of many sizes and one "
            "class label; read it with jdp.data.from_tfds"
        )
    classes = tuple(features[labels[0]].names)
    store = TfdsStore(builder, split, image_key, labels[0])
    transform = transform or ImageTransform(size=tuple(image_size))
    return ImageSplit(store, None, len(classes), transform, classes)


def streamed_image_key(features) -> str | None:
    """The image feature of a TFDS dataset whose images differ in size (height or width
    unknown): those are streamed; None when it has none."""
    for key in features:
        feature = features[key]
        shape = getattr(feature, "shape", ())
        if type(feature).__name__ == "Image" and None in tuple(shape)[:2]:
            return key
    return None


def _tree(root: str, classes) -> tuple[list[str], list[int], tuple[str, ...]]:
    return class_tree(
        root, classes, what="a folder of class folders or one python -m jdp.data pack wrote"
    )


def class_files(root: str, classes: tuple[str, ...]) -> tuple[list[str], list[int]]:
    """The image files under each class folder, and their labels; a class folder without
    images is refused (its class would be trained on as if it never occurred), and so is
    an image name that is not a file (a folder named ``x.jpg``, a broken link). Other
    files are left out with one warning that counts them (hidden ones, such as
    ``.DS_Store``, in silence)."""
    files, labels, others = [], [], []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):  # a split given the classes of another may lack one
            continue
        with os.scandir(folder) as entries:  # a file's kind without a stat of its own
            kinds = {entry.name: entry.is_file() for entry in entries}
        images = sorted(file for file in kinds if file.lower().endswith(IMAGE_SUFFIXES))
        others += [
            os.path.join(folder, file)
            for file in kinds
            if file not in images and not file.startswith(".")
        ]
        if not images:
            raise UsageError(
                f"class folder {shown(folder)} has no images (looked for "
                f"{', '.join(IMAGE_SUFFIXES)}); add its images, or remove the folder"
            )
        for file in images:
            if not kinds[file]:
                path = os.path.join(folder, file)
                what = "a broken link" if os.path.islink(path) else "not a file"
                raise UsageError(f"{shown(path)} is {what}; remove it, or put the image there")
        files += [os.path.join(folder, file) for file in images]
        labels += [label] * len(images)
    if others:
        count = f"{len(others):,} file{'s' * (len(others) != 1)}"
        print(
            f"jdp: warning: left out {count} of {shown(root)}'s class folders "
            f"that are not images by their names ({shown(min(others))}, ...; jdp reads "
            f"{', '.join(IMAGE_SUFFIXES)})",
            file=sys.stderr,
            flush=True,
        )
    return files, labels


def class_tree(
    root: str, classes, *, what: str = "a folder of class folders"
) -> tuple[list[str], list[int], tuple[str, ...]]:
    """The image files of a class-folder tree, their labels and the classes (sorted
    subfolders, or ``classes``: the training split's, which must hold every class folder
    here); UsageError for a missing folder, no class folders, or no images. ``what`` is
    what the missing folder's line asks for."""
    if not os.path.isdir(root):
        raise UsageError(
            f"image folder {shown(root)} {not_there(root, 'a directory')}; give {what}"
        )
    found = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if any(name.endswith(".array_record") for name in os.listdir(root)):  # no images.json
        raise UsageError(
            f"{shown(root)} is a pack that is not complete (its {PACKED_META} is "
            "written last: the packer stopped); pack the images again"
        )
    visible = {name for name in found if not name.startswith(".")}  # not .ipynb_checkpoints
    if classes is not None and (extra := sorted(visible - set(classes))):
        raise UsageError(
            f"{shown(root)} has class folders the training split lacks ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): their images would be left out; move them "
            "into the training split too, or remove them"
        )
    classes = tuple(classes) if classes is not None else tuple(found)
    if not classes:
        raise UsageError(
            f"{shown(root)} has no class subdirectories; put each class's images in a folder "
            "of its own"
        )
    files, labels = class_files(root, classes)
    if not files:
        raise UsageError(
            f"no images in {shown(root)}'s class folders (looked for {', '.join(IMAGE_SUFFIXES)})"
        )
    return files, labels, classes


def _meta(path: str) -> dict:
    try:
        with open(path) as handle:
            meta = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path} ({error}); pack the images again") from None
    if meta.get("format") != FORMAT:
        raise UsageError(
            f"{path} is not a packed split of images; pack them with python -m jdp.data pack"
        )
    return meta


def pack(
    source: str | os.PathLike, out: str | os.PathLike, *, shard_bytes: int = 1 << 30
) -> dict[str, dict]:
    """Packs the class-folder tree ``source`` into ``out``: its ``train``, ``validation``
    and ``test`` folders (with the training split's classes) when it has them, else
    the tree as one split; each image's bytes unchanged, in `from_images`'s order.

    Every image's header is read, so a file no decoder reads is named here, not
    mid-run. Returns ``{split: {"count", "bytes", "shards"}}`` (``""`` for a lone tree).
    """
    source, out = os.fspath(source), os.fspath(out)
    if shard_bytes < 1:
        raise UsageError("--shard-mb must be positive")
    if os.path.isdir(os.path.join(source, "train")):
        classes = _tree(os.path.join(source, "train"), None)[2]
        parts = [split for split in SPLITS if os.path.isdir(os.path.join(source, split))]
        return {
            split: _pack_split(
                os.path.join(source, split), os.path.join(out, split), classes, shard_bytes
            )
            for split in parts
        }
    return {"": _pack_split(source, out, None, shard_bytes)}


def _pack_split(source: str, out: str, classes, shard_bytes: int) -> dict:
    from array_record.python.array_record_module import ArrayRecordWriter

    files, labels, classes = _tree(source, classes)
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, PACKED_META)
    if os.path.exists(meta_path):
        os.remove(meta_path)  # until every shard is written again, this is not a split
    shards, writer, size, total = [], None, 0, 0
    for file in files:
        with open(file, "rb") as handle:
            data = handle.read()
        try:
            header_size(data)
        except (OSError, ValueError, SyntaxError) as error:
            raise UsageError(
                f"cannot read image {file} ({why_unreadable(error)}); remove or replace it"
            ) from None
        if writer is None or (size and size + len(data) > shard_bytes):
            if writer is not None:
                writer.close()
            shards.append(f"images-{len(shards):05d}.array_record")
            writer = ArrayRecordWriter(os.path.join(out, shards[-1]), "group_size:1")
            size = 0
        writer.write(data)
        size += len(data)
        total += len(data)
    writer.close()
    np.save(os.path.join(out, "labels.npy"), np.asarray(labels, np.int32))
    meta = {
        "format": FORMAT,
        "version": 1,
        "classes": list(classes),
        "count": len(files),
        "bytes": total,
        "shards": shards,
    }
    with open(meta_path + ".tmp", "w") as handle:
        json.dump(meta, handle, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    return {"count": len(files), "bytes": total, "shards": len(shards)}
