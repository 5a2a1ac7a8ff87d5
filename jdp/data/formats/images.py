"""Images at ImageNet scale: encoded JPEG/PNG bytes read per batch, decoded in the loader.

An `ImageSplit` holds only where its images are (a class-folder tree's file names,
or the array_record files ``python -m jdp.data pack`` writes, `jdp.data.pack`) and
their labels; ``read`` returns the encoded bytes of a batch's examples, and its
`ImageTransform` decodes, crops and resizes them in the loader's thread or Grain's
worker processes. The split is never in memory: ImageNet's 1.28M training images
are 140 GB encoded and would be 190 GB decoded.

Training crops are Inception's (a random area of 8-100% of the image at an aspect
ratio of 3/4-4/3, resized to ``size``, flipped with probability 1/2), evaluation's
a centre crop of 87.5% of the shorter side, resized (the Flax ImageNet example's).
The crops are uint8: they travel to the devices at a quarter of float32's bytes and
are normalised there (`Normalize`, the model's input function). JPEGs are decoded by
``simplejpeg`` (libjpeg-turbo, a third faster than Pillow here; ``python -m
jdp.bench input --images`` measures both), at the smallest DCT scale that still
covers the crop; other formats by Pillow.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import NamedTuple

import numpy as np

from jdp.errors import UsageError
from jdp.tool import shown

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Where a packed split keeps what it holds (`jdp.data.pack`).
PACKED_META = "images.json"
_JPEG = b"\xff\xd8"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class Crops(NamedTuple):
    """The random choices for a batch of training crops: ``(n, attempts, 4)`` uniforms
    (area, aspect ratio, left, top of each attempt) and ``(n,)`` flips."""

    uniforms: np.ndarray
    flips: np.ndarray

    def take(self, rows: np.ndarray | slice) -> Crops:
        return Crops(self.uniforms[rows], self.flips[rows])


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """Encoded images -> uint8 ``(n, height, width, 3)`` crops: Inception's random-resized
    crop and flip in training (with `Crops`), a centre crop in evaluation (without).

    ``mean`` and ``std`` (per channel, in units of 255) are applied on the devices by
    `Normalize`, not here. ``attempts`` random crops are tried before the centre crop.
    """

    size: tuple[int, int] = (224, 224)
    area: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    attempts: int = 10
    flip: bool = True
    center: float = 0.875  # evaluation's crop: this fraction of the shorter side
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    augments = True

    def draw(self, rng: np.random.Generator, num_examples: int) -> Crops:
        """The random choices of ``num_examples`` training crops."""
        uniforms = rng.random((num_examples, self.attempts, 4))
        flips = rng.random(num_examples) < 0.5 if self.flip else np.zeros(num_examples, bool)
        return Crops(uniforms, flips)

    def __call__(self, encoded: np.ndarray, crops: Crops | None = None) -> np.ndarray:
        height, width = self.size
        out = np.empty((len(encoded), height, width, 3), np.uint8)
        for row, data in enumerate(encoded):
            draws = None if crops is None else crops.uniforms[row]
            try:
                out[row] = self.one(data, draws)
            except (OSError, ValueError, SyntaxError) as error:
                where, why = getattr(data, "where", "an image of the batch"), why_unreadable(error)
                raise UsageError(
                    f"cannot decode {where} ({why}); its header reads but its data is damaged "
                    "(cut short?): replace it"
                ) from None
            if crops is not None and crops.flips[row]:
                out[row] = out[row, :, ::-1]
        return out

    def one(self, data: bytes, uniforms: np.ndarray | None) -> np.ndarray:
        """One image's crop: random from ``uniforms`` ``(attempts, 4)``, else the centre's."""
        full = image_size(data)
        box = self.random_box(full, uniforms) if uniforms is not None else None
        box = box or self.center_box(full)
        return crop_resize(data, full, box, self.size)

    def random_box(self, full: tuple[int, int], uniforms: np.ndarray):
        """``(left, top, right, bottom)`` of the first attempt that fits, or None."""
        height, width = full
        low, high = math.log(self.ratio[0]), math.log(self.ratio[1])
        for area, ratio, left, top in uniforms:
            target = height * width * (self.area[0] + area * (self.area[1] - self.area[0]))
            aspect = math.exp(low + ratio * (high - low))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                x, y = int(left * (width - w + 1)), int(top * (height - h + 1))
                return x, y, x + w, y + h
        return None

    def center_box(self, full: tuple[int, int]):
        height, width = full
        side = max(1, int(self.center * min(height, width)))
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` of an encoded image, from its header; ValueError for an image
    Pillow reads with more pixels than it decodes (twice ``Image.MAX_IMAGE_PIXELS``: a
    decompression bomb, a small file that decodes into gigabytes). A JPEG is decoded at
    a scale its crop needs (`crop_resize`), so a large one costs little."""
    if data[:2] == _JPEG:
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return height, width
        except ValueError:
            pass  # a JPEG libjpeg-turbo's header reader refuses: Pillow's may not
    from PIL import Image

    try:
        with warnings.catch_warnings():  # past half the limit Pillow warns; past it, this
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(_bytes_io(data)) as image:
                return image.height, image.width
    except Image.DecompressionBombError as error:
        raise ValueError(str(error)) from None


def crop_resize(data: bytes, full: tuple[int, int], box, size: tuple[int, int]) -> np.ndarray:
    """``box`` of the encoded image resized to ``size`` (bilinear, antialiased), RGB
    uint8. A JPEG is decoded at the smallest DCT scale (1, 1/2, 1/4, 1/8) at which the
    box still has at least ``size`` pixels, so a large photo costs little more than a
    small one."""
    from PIL import Image

    left, top, right, bottom = box
    pixels = None
    if data[:2] == _JPEG:
        need_h = math.ceil(full[0] * size[0] / (bottom - top))
        need_w = math.ceil(full[1] * size[1] / (right - left))
        pixels = _decode_jpeg(data, min(need_h, full[0]), min(need_w, full[1]))
    if pixels is None:
        with Image.open(_bytes_io(data)) as image:
            pixels = np.asarray(image.convert("RGB"))
    scale_h, scale_w = pixels.shape[0] / full[0], pixels.shape[1] / full[1]
    image = Image.fromarray(pixels)
    scaled = (left * scale_w, top * scale_h, right * scale_w, bottom * scale_h)
    resized = image.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=scaled)
    return np.asarray(resized)


def _decode_jpeg(data: bytes, min_height: int, min_width: int) -> np.ndarray | None:
    import simplejpeg

    try:
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_height=min_height, min_width=min_width
        )
    except ValueError:  # CMYK and the like: Pillow converts them
        return None


def why_unreadable(error: Exception) -> str:
    """A decoder's complaint without Pillow's ``<_io.BytesIO object at ...>``."""
    text = str(error).split(" <_io.BytesIO", 1)[0]
    return "not an image Pillow or libjpeg-turbo reads" if "cannot identify" in text else text


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)


@dataclasses.dataclass(frozen=True)
class Normalize:
    """The model's input function for uint8 images: ``(x - 255 mean) / (255 std)`` in
    float32 on the devices, per channel (`jdp.models.from_linen`'s ``inputs``)."""

    key: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, batch) -> tuple:
        import jax.numpy as jnp

        x = batch[self.key].astype(jnp.float32)
        shape = (1,) * (x.ndim - 1) + (-1,)  # per channel, the last axis
        mean = jnp.asarray(self.mean, jnp.float32).reshape(shape) * 255.0
        scale = jnp.asarray(1.0 / (255.0 * np.asarray(self.std)), jnp.float32).reshape(shape)
        return ((x - mean) * scale,)


class FileStore:
    """A class-folder tree's images, read by name: the names kept as one byte string
    (ImageNet's 1.28M take 40 MB, not the 150 MB of Python strings)."""

    def __init__(self, root: str, names: list[str]):
        self.root = root
        encoded = [os.fsencode(name) for name in names]  # a name not UTF-8 as its bytes
        self._blob = b"".join(encoded)
        self._ends = np.cumsum([len(name) for name in encoded], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    @property
    def names(self) -> bytes:
        """Every file's name, end to end, and where each ends."""
        return self._blob + self._ends.tobytes()

    def name(self, index: int) -> str:
        start = int(self._ends[index - 1]) if index else 0
        return os.fsdecode(self._blob[start : int(self._ends[index])])

    def describe(self, index: int) -> str:
        return shown(os.path.join(self.root, self.name(index)))  # a name not UTF-8 escaped

    def read(self, indices: np.ndarray) -> list[bytes]:
        out = []
        for index in np.asarray(indices).reshape(-1):
            path = os.path.join(self.root, self.name(int(index)))
            try:
                with open(path, "rb") as handle:
                    out.append(handle.read())
            except OSError as error:
                raise UsageError(
                    f"cannot read image {path} ({error}); restore it, or remove it and start again"
                ) from None
        return out


class PackedStore:
    """The array_record files of a packed split (`jdp.data.pack`), read by record."""

    def __init__(self, paths: list[str]):
        from array_record.python.array_record_data_source import ArrayRecordDataSource

        self.paths = paths
        self._source = ArrayRecordDataSource(paths)

    def __len__(self) -> int:
        return len(self._source)

    def describe(self, index: int) -> str:
        return f"record {index} of the images packed in {os.path.dirname(self.paths[0])}"

    def read(self, indices: np.ndarray) -> list[bytes]:
        keys = [int(index) for index in np.asarray(indices).reshape(-1)]
        return list(self._source.__getitems__(keys))


class TfdsStore:
    """A prepared TFDS split's encoded images and labels, read without decoding (TFDS's
    own array_record data source, which Grain's workers take as it is)."""

    def __init__(self, builder, split: str, image_key: str, label_key: str):
        import tensorflow_datasets as tfds

        self.image_key, self.label_key = image_key, label_key
        self.paths = [os.fspath(path) for path in builder.info.splits[split].filepaths]
        decoders = {image_key: tfds.decode.SkipDecoding()}
        self._source = builder.as_data_source(split=split, decoders=decoders)

    def __len__(self) -> int:
        return len(self._source)

    def describe(self, index: int) -> str:
        return f"example {index} of {os.path.dirname(self.paths[0])}"

    def read_with_labels(self, indices: np.ndarray) -> tuple[list[bytes], np.ndarray]:
        keys = [int(index) for index in np.asarray(indices).reshape(-1)]
        examples = self._source.__getitems__(keys)
        labels = np.array([example[self.label_key] for example in examples], np.int32)
        return [example[self.image_key] for example in examples], labels


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSplit:
    """A split of encoded images read per batch: ``store`` (`FileStore`, `PackedStore`,
    `TfdsStore`) and ``labels`` (None: the store reads them with the images); ``read``
    returns the batch's encoded bytes (an object array) under ``image``, which
    ``transform`` decodes into uint8 crops."""

    store: FileStore | PackedStore | TfdsStore
    labels: np.ndarray | None
    num_classes: int
    transform: ImageTransform = ImageTransform()
    classes: tuple[str, ...] | None = None
    rows: np.ndarray | None = None  # the store's records of this split, when a subset
    kind = "image"
    input_key, label_key = "image", "label"
    map = None
    decodes = True  # read a batch at a time (`jdp.data.loader.pipeline`)

    def __len__(self) -> int:
        if self.labels is not None:
            return len(self.labels)
        return len(self.store) if self.rows is None else len(self.rows)

    @property
    def example_shape(self) -> tuple[int, ...]:
        return (*self.transform.size, 3)

    @property
    def normalize(self) -> Normalize:
        return Normalize(self.input_key, self.transform.mean, self.transform.std)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices).reshape(-1)
        records = indices if self.rows is None else self.rows[indices]
        encoded = np.empty(len(indices), object)
        if self.labels is None:
            encoded[:], labels = self.store.read_with_labels(records)
            if len(labels) and not 0 <= labels.min() <= labels.max() < self.num_classes:
                raise UsageError(
                    f"a label of this batch is outside the {self.num_classes} "
                    "classes; prepare the dataset again"
                )
        else:
            encoded[:], labels = self.store.read(records), self.labels[indices]
        for record, data in zip(records, encoded, strict=True):  # named here, not mid-decode
            try:
                image_size(data)
            except (OSError, ValueError, SyntaxError) as error:
                where, why = self.store.describe(int(record)), why_unreadable(error)
                raise UsageError(
                    f"cannot read image {where} ({why}); remove or replace it"
                ) from None
        encoded[:] = [
            _Encoded(data, self.store.describe(int(record)))
            for record, data in zip(records, encoded, strict=True)
        ]
        return {"image": encoded, "label": labels}

    def take(self, indices: np.ndarray) -> ImageSplit:
        """The split of these examples, in this order."""
        rows = np.asarray(indices) if self.rows is None else self.rows[indices]
        labels = None if self.labels is None else self.labels[indices]
        return dataclasses.replace(self, labels=labels, rows=rows)


class _Encoded(bytes):
    """An image's bytes that know where they were read, for the line naming a damaged one."""

    def __new__(cls, data: bytes, where: str):
        encoded = super().__new__(cls, data)
        encoded.where = where
        return encoded

    def __reduce__(self):  # pickled (to a loader worker) with its place
        return _Encoded, (bytes(self), self.where)
