"""Data shared by the workloads: learnable synthetic sets, Wikitext token blocks, ImageFolder.

Everything here is plain PyTorch `Dataset`s whose items are `(input, target)` tensors:

- `MarkovTokens`: token sequences from a fixed random Markov chain (language, no files).
- `SyntheticImages`: class-conditional images: a fixed per-class template plus noise (vision, no files).
- `TokenBlocks` over a uint16 memmap made by `token_cache()`: text file -> GPT-2 BPE ids, cached once
  (workloads/token_cache.py, re-exported here).
- `image_folder()` + `imagenet_transforms()`: ImageFolder layout with the reference transforms, decoded by
  torchvision.io on uint8 tensors (`ImageFiles`, optional RAM cache of decoded images) or by PIL.

The synthetic sets are seeded by constants (not the trainer seed) so that every run, rank and
framework sees the same data; only the model init and the sampling order follow the trainer seed.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ptbench.core.errors import ConfigError
from ptbench.workloads.token_cache import (  # noqa: F401 - the token cache's names, as D.<name> in workloads and tests
    TOKENIZER_FILES,
    TokenBlocks,
    _stderr,
    _writable_dir,
    blank_text,
    encode_text,
    gpt2_tokenizer,
    load_tokens,
    read_utf8,
    token_cache,
)

SYNTHETIC_SEED = 0x5EED  # fixed: synthetic data never depends on the trainer seed
_SPLIT_IDS = {"train": 1, "val": 2}


# ---------------------------------------------------------------------------------------------
# synthetic language data
# ---------------------------------------------------------------------------------------------
class MarkovTokens(Dataset):
    """Sequences from a fixed first-order Markov chain over a small sub-vocabulary.

    `n_states` token ids (drawn once from the full vocabulary) each have `fanout` likely
    successors with probabilities `probs`: the entropy rate is ~1.1 nats against ln(50257) = 10.8
    for a uniform guess, so even a tiny GPT's loss falls visibly within a few hundred steps
    (first the unigram over the sub-vocabulary, ln 256 = 5.5, then the transitions).
    Items: (input_ids [T] int64, targets [T] int64) with targets = the sequence shifted by one.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int,
        split: str = "train",
        n_states: int = 256,
        probs: tuple[float, ...] = (0.6, 0.2, 0.1, 0.1),
    ):
        chain = np.random.default_rng([SYNTHETIC_SEED, 0])
        n_states = min(n_states, vocab_size)
        self.token_ids = chain.permutation(vocab_size)[:n_states]  # state -> token id
        self.successors = chain.integers(0, n_states, size=(n_states, len(probs)))  # state -> next states
        cum = np.cumsum(np.asarray(probs, dtype=np.float64))
        cum /= cum[-1]
        rng = np.random.default_rng([SYNTHETIC_SEED, _SPLIT_IDS[split]])
        u = rng.random((num_samples, seq_len + 1))
        states = np.empty((num_samples, seq_len + 1), dtype=np.int64)
        states[:, 0] = rng.integers(0, n_states, size=num_samples)
        for t in range(1, seq_len + 1):
            choice = np.searchsorted(cum, u[:, t], side="right").clip(max=len(probs) - 1)
            states[:, t] = self.successors[states[:, t - 1], choice]
        self.seqs = torch.from_numpy(self.token_ids[states].astype(np.int64))

    def __len__(self) -> int:
        return self.seqs.shape[0]

    def __getitem__(self, i: int):
        s = self.seqs[i]
        return s[:-1], s[1:]


# ---------------------------------------------------------------------------------------------
# synthetic vision data
# ---------------------------------------------------------------------------------------------
class SyntheticImages(Dataset):
    """Class-conditional images: a fixed smooth random template per class, weak, under unit noise.

    A template is a 3x8x8 Gaussian pattern upsampled (bilinear); an image is
    `signal * template + N(0, 1)` drawn on a grid of min(image_size, 32) pixels and, for larger
    images, upsampled to image_size, so the task is equally hard at 32 and 224 px and pixel values
    stay near unit scale. With the default signal 0.5 and 2048 images, resnet50_tiny (SGD 0.05)
    is at chance after epoch 1 and at ~88 % / ~98 % val accuracy after epochs 2 / 4: a curve, not
    a step. (Weaker signal, e.g. 0.25, gives ~40 % after 4 epochs.)
    Images are generated per item from (seed, split, index): nothing big is held in memory and
    the same index always gives the same image. Items: (image [3,H,W] float32, label int64).
    """

    def __init__(self, num_samples: int, num_classes: int, image_size: int, split: str = "train", signal: float = 0.5):
        g = torch.Generator().manual_seed(SYNTHETIC_SEED)
        self.templates = torch.randn(num_classes, 3, 8, 8, generator=g)
        self.num_samples, self.num_classes = num_samples, num_classes
        self.image_size, self.signal = image_size, signal
        self.split_id = _SPLIT_IDS[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        g = torch.Generator().manual_seed((SYNTHETIC_SEED * 1_000_003 + self.split_id) * 10_000_019 + int(i))
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        grid = min(self.image_size, 32)
        t = F.interpolate(self.templates[label : label + 1], size=(grid, grid), mode="bilinear", align_corners=False)
        image = self.signal * t + torch.randn(1, 3, grid, grid, generator=g)
        if grid != self.image_size:
            image = F.interpolate(image, size=(self.image_size,) * 2, mode="bilinear", align_corners=False)
        return image[0], torch.tensor(label, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def imagenet_transforms(image_size: int, train: bool, augment: bool = True, uint8: bool = False):
    """torchvision reference transforms. Train (with augment): RandomResizedCrop + flip;
    otherwise Resize(image_size / 0.875) + CenterCrop (256 -> 224 on ImageNet, 36 -> 32 on CIFAR).
    uint8=True: the same geometric transforms only, for uint8 image tensors (`normalize_uint8` follows);
    they draw the same random numbers as on PIL images, so one seed picks the same crops and flips."""
    from torchvision import transforms as T

    norm = [] if uint8 else [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if train and augment:
        return T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), *norm])
    return T.Compose([T.Resize(int(image_size / 0.875)), T.CenterCrop(image_size), *norm])


_MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
_STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def normalize_uint8(image: torch.Tensor) -> torch.Tensor:
    """uint8 (or whole-valued float) [3,H,W] in 0..255 -> float32 normalised: ToTensor + Normalize's operations."""
    return image.float().div_(255).sub_(_MEAN).div_(_STD)


class CropFlip:
    """RandomResizedCrop(size) + RandomHorizontalFlip() on a uint8 [3,H,W] tensor, bit for bit what
    torchvision's two transforms give (tests/test_workloads.py compares them, same seed): the same
    `get_params` draws, the same antialiased bilinear resize in float32 rounded to whole values, the
    same flip draw. Without the transforms' per-call dispatch, logging and dtype round trip it costs
    ~22 % less per image (measured on 2 loaded cores); returns float32 whole values for `normalize_uint8`."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms import RandomResizedCrop

        i, j, h, w = RandomResizedCrop.get_params(image, self.scale, self.ratio)
        x = F.interpolate(
            image[None, :, i : i + h, j : j + w].float(),
            size=(self.size, self.size),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )[0].round_()
        return x.flip(-1) if torch.rand(1) < 0.5 else x


def decode_rgb(path: str | os.PathLike) -> torch.Tensor:
    """An image file as uint8 [3,H,W] RGB, decoded by torchvision.io (libjpeg-turbo for JPEG): the same
    pixels as PIL's `.convert("RGB")` on the CIFAR-10 subset, ~5x faster."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(str(path)), mode=ImageReadMode.RGB)


BAD_IMAGES = ("fail", "skip")
# what a damaged or unreadable file raises: torchvision.io RuntimeError, PIL OSError (UnidentifiedImageError,
# "image file is truncated"), a read error OSError; caught around the decode only, never the transforms
DECODE_ERRORS = (OSError, RuntimeError, ValueError)


class BadImage(ConfigError):
    """An image file that cannot be decoded, with data.bad_images=fail. Raised in a DataLoader worker, it
    reaches the rank re-made by torch from the worker's formatted traceback ("Caught BadImage in DataLoader
    worker process 0. Original Traceback ..."): the one line is taken back out of that text, so the
    console and the record name the file, not the worker's traceback."""

    def __init__(self, message: str):
        if message.startswith("Caught "):
            lines = re.findall(rf"{type(self).__name__}: (.*)$", message, re.M)
            message = lines[-1] if lines else message
        super().__init__(message)


def _decode_failure(e: BaseException) -> str:
    """What a decoder raised, in a few words: its type and first sentence, without torchvision's C++ location."""
    text = re.sub(r"^.*\.cpp:\d+, ", "", str(e).strip().split("\n")[0])
    text = text.split(". ")[0][:120]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _cannot_decode(path, why: str) -> str:
    return (
        f"data.root: image {path} cannot be decoded ({why}): replace or remove the file, or set "
        "data.bad_images=skip to skip such files and count them in the record"
    )


class DamagedImages:
    """data.bad_images for a dataset of image files (`samples`: [(path, label)]). fail: the first damaged
    file ends the run in one line naming it. skip: it is named once in one line, marked, and every item
    that would be it is the next good file (with its own label); `skipped()` counts the files marked.

    The marks live in shared memory (multiprocessing.RawArray), so the DataLoader workers that find
    damaged files, and the rank that writes the record, see the same ones."""

    def _init_damage(self, policy: str) -> None:
        import ctypes
        import multiprocessing

        if policy not in BAD_IMAGES:
            raise ConfigError(f"data.bad_images={policy}: choose {' or '.join(BAD_IMAGES)}")
        self.bad_images = policy
        self._bad = multiprocessing.RawArray(ctypes.c_bool, max(1, len(self.samples)))

    def skipped(self) -> int:
        return sum(self._bad[: len(self.samples)])

    def skipped_files(self, limit: int = 10) -> list[str]:
        return [str(self.samples[j][0]) for j in range(len(self.samples)) if self._bad[j]][:limit]

    def damaged(self, j: int, e: BaseException) -> None:
        """File j failed to decode with `e`: raise (fail) or mark it and say so once (skip)."""
        path = self.samples[j][0]
        why = _decode_failure(e)
        if self.bad_images == "fail":
            raise BadImage(_cannot_decode(path, why)) from None
        if not self._bad[j]:
            self._bad[j] = True
            _stderr(f"warning: image {path} cannot be decoded ({why}): skipped and counted (data.bad_images=skip)")

    def first_good(self, i: int, load):
        """(j, load(j)) for the first file from item i on that decodes (skipping marked ones)."""
        n = len(self.samples)
        for k in range(n):
            j = (i + k) % n
            if self._bad[j]:
                continue
            try:
                return j, load(j)
            except DECODE_ERRORS as e:
                self.damaged(j, e)
        raise BadImage(f"data.root: none of the {n} images under {self.root} can be decoded: check the folder")


class ImageFiles(DamagedImages, Dataset):
    """ImageFolder's listing (<root>/<class>/*, classes sorted) decoded by torchvision.io, the reference
    transforms applied to uint8 tensors, then converted to float and normalised per image.

    `cache_decoded`: every image is decoded once, here, into a list of uint8 tensors in RAM
    (`cache_time_s`, `cache_bytes` say what it cost), so a step only crops and flips. Items are the
    same tensors with or without the cache (same seed): decoding is deterministic. A damaged file:
    `bad_images` (`DamagedImages`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int,
        train: bool,
        augment: bool = True,
        cache_decoded: bool = False,
        bad_images: str = "fail",
    ):
        from torchvision.datasets import ImageFolder

        listing = ImageFolder(str(root))  # scans the folders only; its PIL loader is never called
        self.root = str(root)
        self.samples, self.classes, self.targets = listing.samples, listing.classes, listing.targets
        self._init_damage(bad_images)
        # train: the reference RandomResizedCrop + flip (CropFlip: the same numbers, cheaper); val: Resize + CenterCrop
        self.transform = (
            CropFlip(image_size) if train and augment else imagenet_transforms(image_size, train, augment, uint8=True)
        )
        self.images: list[torch.Tensor | None] | None = None
        self.cache_time_s = 0.0
        self.cache_bytes = 0
        if cache_decoded:
            t0 = time.perf_counter()
            with warnings.catch_warnings():  # torchvision 0.29 warns at every decode that TorchCodec succeeds it
                warnings.simplefilter("ignore", DeprecationWarning)
                self.images = [self._decode_once(j) for j in range(len(self.samples))]
            self.cache_time_s = time.perf_counter() - t0
            self.cache_bytes = sum(im.numel() for im in self.images if im is not None)

    def _decode_once(self, j: int) -> torch.Tensor | None:
        try:
            return decode_rgb(self.samples[j][0])
        except DECODE_ERRORS as e:
            self.damaged(j, e)  # marked (skip): never read from the cache
            return None

    def _load(self, j: int) -> torch.Tensor:
        return self.images[j] if self.images is not None else decode_rgb(self.samples[j][0])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        j, image = self.first_good(i, self._load)
        return normalize_uint8(self.transform(image)), self.samples[j][1]


class PilImages(DamagedImages, Dataset):
    """torchvision's ImageFolder with its PIL loader and the reference transforms on PIL images (the
    reference path), with data.bad_images (`DamagedImages`)."""

    def __init__(self, root: str | os.PathLike, transform, bad_images: str = "fail"):
        from torchvision.datasets import ImageFolder

        self.folder = ImageFolder(str(root), transform=transform)
        self.root, self.samples = str(root), self.folder.samples
        self.classes, self.targets, self.transform = self.folder.classes, self.folder.targets, transform
        self._init_damage(bad_images)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        j, image = self.first_good(i, lambda j: self.folder.loader(self.samples[j][0]))
        return self.transform(image), self.samples[j][1]


DECODERS = ("torchvision", "pil")


def image_folder(
    root: str | os.PathLike,
    split: str,
    image_size: int,
    augment: bool = True,
    decoder: str = "torchvision",
    cache_decoded: bool = False,
    bad_images: str = "fail",
):
    """<root>/<split>/<class>/* as a dataset of (image [3,S,S] float32 normalised, label int).

    decoder=pil: `PilImages` (torchvision's ImageFolder, the reference transforms on PIL images: the reference
    path); decoder=torchvision: `ImageFiles` (same transforms on uint8 tensors, optional RAM cache).
    bad_images: what a file that cannot be decoded does (`DamagedImages`): fail | skip."""
    train = split == "train"
    if decoder == "pil":
        if cache_decoded:
            raise ConfigError("data.cache_decoded=true needs data.decoder=torchvision (the PIL path decodes per item)")
        return PilImages(Path(root) / split, imagenet_transforms(image_size, train, augment), bad_images)
    if decoder != "torchvision":
        raise ConfigError(f"data.decoder={decoder}: choose {' or '.join(DECODERS)}")
    return ImageFiles(Path(root) / split, image_size, train, augment, cache_decoded, bad_images)


def decoded_bytes_estimate(split_dir: str | os.PathLike, bad_images: str = "fail") -> int:
    """Bytes a RAM cache of <split_dir>'s decoded images would take: the first decodable image's x the image
    count. A file that cannot be decoded is what the loader makes of it (`DamagedImages`): with
    bad_images=fail the first one ends the check in the loader's one line naming it; with skip the next is
    tried (the loader names it when it meets it)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    files = [
        Path(c.path) / f
        for c in sorted(os.scandir(split_dir), key=lambda e: e.name)
        if c.is_dir()
        for f in sorted(os.listdir(c.path))
        if f.lower().endswith(IMG_EXTENSIONS)
    ]
    for path in files:
        try:
            with warnings.catch_warnings():  # torchvision 0.29 warns at every decode that TorchCodec succeeds it
                warnings.simplefilter("ignore", DeprecationWarning)
                return decode_rgb(path).numel() * len(files)
        except DECODE_ERRORS as e:
            if bad_images == "fail":
                raise BadImage(_cannot_decode(path, _decode_failure(e))) from None
    return 0


def class_folders(split_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
