"""Data shared by the workloads: learnable synthetic sets, Wikitext token blocks, ImageFolder.

Everything here is plain PyTorch `Dataset`s whose items are `(input, target)` tensors:

- `MarkovTokens`: token sequences from a fixed random Markov chain (language, no files).
- `SyntheticImages`: class-conditional images: a fixed per-class template plus noise (vision, no files).
- `TokenBlocks` over a uint16 memmap made by `token_cache()`: text file -> GPT-2 BPE ids, cached once.
- `image_folder()` + `imagenet_transforms()`: ImageFolder layout with the reference transforms, decoded by
  torchvision.io on uint8 tensors (`ImageFiles`, optional RAM cache of decoded images) or by PIL.

The synthetic sets are seeded by constants (not the trainer seed) so that every run, rank and
framework sees the same data; only the model init and the sampling order follow the trainer seed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ptbench.core.errors import ConfigError

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
# GPT-2 BPE + token cache
# ---------------------------------------------------------------------------------------------
TOKENIZER_FILES = ("vocab.json", "merges.txt")


def gpt2_tokenizer(tokenizer_dir: str | os.PathLike):
    """GPT-2 byte-level BPE from local vocab.json + merges.txt ("Hello world" -> [15496, 995])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = Path(tokenizer_dir)
    tok = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        h.update((Path(tokenizer_dir) / name).read_bytes())
    return h.hexdigest()[:12]


# A chunk may end at "\n" only where the next line starts with an optional space and then a
# non-space: GPT-2's pre-tokenizer regex cannot match across such a point, so encoding the
# chunks separately gives exactly the ids of encoding the file whole (checked on Wikitext-2),
# and `encode_batch` can use every core.
_SAFE_LINE_START = re.compile(r" ?\S")


def encode_text(tok, text: str, chunk_chars: int = 1 << 16) -> np.ndarray:
    """Text -> uint16 token ids, identical to `tok.encode(text).ids`, encoded in parallel chunks."""
    chunks, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if cur and n >= chunk_chars and _SAFE_LINE_START.match(line):
            chunks.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if cur:
        chunks.append("".join(cur))
    if tok.get_vocab_size() > 65535:
        raise ConfigError(f"data.tokenizer_dir: vocabulary of {tok.get_vocab_size()} does not fit the uint16 cache")
    parts = [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(chunks, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _writable_dir(d: Path) -> bool:
    return _unwritable(d) is None


def _unwritable(d: Path) -> OSError | None:
    """Why no file can be made in `d` (made if missing), or None if one can."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
        return None
    except OSError as e:
        return e


def _user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainbench"


def cache_dirs(text_path: Path, cache_dir: str | None) -> list[Path]:
    """Where the cache may live, in order: data.cache_dir, $BENCH_CACHE_DIR, the user's cache folder
    ($XDG_CACHE_HOME/trainbench, default ~/.cache/trainbench: never into a dataset folder, which may be
    shared), <root>/.bench_cache (only when the user's cache folder is not writable, and where
    an older version left a cache)."""
    if cache_dir:
        return [Path(cache_dir)]
    if os.environ.get("BENCH_CACHE_DIR"):
        return [Path(os.environ["BENCH_CACHE_DIR"])]
    return [_user_cache_dir(), text_path.parent / ".bench_cache"]


def token_cache(
    text_path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    cache_dir: str | None = None,
    local_rank: int = 0,
    wait_s: float | None = None,
    say=None,
) -> Path:
    """Path of the uint16 token-id file for `text_path`, building it if needed.

    The name is keyed by the text file's name, size and mtime and a hash of the tokenizer files,
    so an edited file or another tokenizer gives a new cache, and ends with the token count it was
    written with (KEY.N.u16): a file whose size is not 2 N bytes (cut short by a full disk, a copy, a
    crash of the file system) is rebuilt, with one line to `say` (default: stderr) saying so, instead
    of training on part of the text. `local_rank` 0 builds (temp file, then an atomic rename, so
    concurrent builders on a shared file system are harmless); other ranks wait for a complete file,
    at most `wait_s` seconds (default 300 s + 2 s per MB of text, env BENCH_DATA_WAIT_S overrides).
    """
    text_path = Path(text_path)
    st = text_path.stat()
    key = (
        f"{text_path.parent.name}.{text_path.name}.{st.st_size}.{st.st_mtime_ns}.{tokenizer_fingerprint(tokenizer_dir)}"
    )
    candidates = cache_dirs(text_path, cache_dir)

    found, damaged = _cached(candidates, key)
    if found is not None:
        return found
    if local_rank != 0:
        return _wait_for_cache(candidates, key, local_rank, wait_s, st.st_size)
    for path, tokens in damaged:
        (say or _stderr)(
            f"warning: token cache {path} holds {path.stat().st_size} bytes, not the {2 * tokens} of its "
            f"{tokens} tokens (cut short after it was written): rebuilding it from {text_path}"
        )
        path.unlink(missing_ok=True)
    target_dir, why = None, {}
    for d in candidates:  # in order, up to the first writable one: a later one is not made needlessly
        why[d] = _unwritable(d)
        if why[d] is None:
            target_dir = d
            break
    if target_dir is None:
        said = ", ".join(f"{d} ({e.strerror or e})" for d, e in why.items())
        raise ConfigError(f"data.cache_dir: no file can be made in {said}; set data.cache_dir=<a writable folder>")
    ids = encode_text(gpt2_tokenizer(tokenizer_dir), read_utf8(text_path))
    final = target_dir / f"{key}.{ids.size}.u16"
    _write_cache(ids, final, target_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    return final


def _write_cache(ids: np.ndarray, final: Path, tmp: Path) -> None:
    """`ids` into `final` through `tmp` (an atomic rename); a storage that refuses (a full disk, a quota, a
    read-only file system) ends in one line naming the file, its size and the fix, the partial file removed."""
    from ptbench.core.records import storage_error

    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(ids))  # not ids.tofile: a full disk would be an OSError without its errno
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        size = f"{ids.nbytes / 2**20:.1f} MiB" if ids.nbytes >= 2**20 else f"{-(-ids.nbytes // 1024)} KiB"
        fix = f"or set data.cache_dir=<a folder with {size} free> (the token cache)"
        raise storage_error(e, final, fix) from e
    finally:
        if tmp.exists():
            tmp.unlink()


def _cached(candidates: list[Path], key: str) -> tuple[Path | None, list[tuple[Path, int]]]:
    """(the first cache file of `key` whose size matches the token count in its name, or None;
    [(file, its count)] of those that do not)."""
    pattern = re.compile(re.escape(key) + r"\.(\d+)\.u16")
    damaged = []
    for d in candidates:
        for path in sorted(d.glob(f"{glob.escape(key)}.*.u16")) if d.is_dir() else []:
            m = pattern.fullmatch(path.name)
            if not m:
                continue
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # replaced by another builder meanwhile
                continue
            if size == 2 * int(m.group(1)):
                return path, []
            damaged.append((path, int(m.group(1))))
    return None, damaged


def _wait_for_cache(candidates: list[Path], key: str, local_rank: int, wait_s: float | None, text_bytes: int) -> Path:
    if wait_s is None:
        wait_s = float(os.environ.get("BENCH_DATA_WAIT_S", 300 + 2 * text_bytes / 1e6))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        found, _ = _cached(candidates, key)
        if found is not None:
            return found
    raise TimeoutError(
        f"local rank {local_rank} waited {wait_s:.0f} s for the token cache {key}.*.u16 "
        f"(built by local rank 0) in {', '.join(map(str, candidates))}"
    )


def read_utf8(path: Path) -> str:
    """The text of `path`, strict UTF-8. Invalid bytes end the run with one line naming the file and the
    byte offset, rather than being decoded with replacement characters: WikiText is UTF-8, so such a byte
    means a damaged or a wrong file, and replacing it would train, silently, on other tokens than the
    dataset's (a benchmark's token count and loss would no longer compare with anyone's)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"data.root: {path} is not valid UTF-8 at byte {e.start} (line {line}, byte 0x{data[e.start]:02x}): "
            "restore the file, or convert it to UTF-8 (iconv -f <its encoding> -t utf-8)"
        ) from None


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def blank_text(path: str | os.PathLike, probe: int = 1 << 16) -> bool:
    """The text file holds nothing to tokenize: empty, or (when small) only whitespace."""
    size = os.path.getsize(path)
    if size > probe:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """The token ids of a cache file as a read-only uint16 memmap."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r")


class TokenBlocks(Dataset):
    """Non-overlapping blocks of seq_len + 1 tokens: input = block[:-1], target = block[1:] (int64).

    Holds only the cache path; each process (DataLoader workers included) opens its own memmap,
    so nothing large is pickled when workers are spawned.
    """

    def __init__(self, cache_path: str | os.PathLike, seq_len: int, source: str | os.PathLike | None = None):
        self.path, self.seq_len = str(cache_path), seq_len
        self.num_tokens = os.path.getsize(self.path) // 2
        self.n = self.num_tokens // (seq_len + 1)
        self._tokens = None
        if self.n == 0:
            raise ConfigError(
                f"data.root: {source or self.path} holds {self.num_tokens} tokens, fewer than "
                f"workload.seq_len + 1 = {seq_len + 1}; lower workload.seq_len or use a longer file"
            )

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self._tokens is None:
            self._tokens = load_tokens(self.path)
        L = self.seq_len + 1
        block = torch.from_numpy(self._tokens[i * L : (i + 1) * L].astype(np.int64))
        return block[:-1], block[1:]


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
        text = re.sub(r"^.*\.cpp:\d+, ", "", str(e).strip().split("\n")[0])  # torchvision's C++ source location
        text = text.split(". ")[0][:120]  # its first sentence
        why = f"{type(e).__name__}: {text}" if text else type(e).__name__
        if self.bad_images == "fail":
            raise BadImage(
                f"data.root: image {path} cannot be decoded ({why}): replace or remove the file, or set "
                "data.bad_images=skip to skip such files and count them in the record"
            ) from None
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


def decoded_bytes_estimate(split_dir: str | os.PathLike) -> int:
    """Bytes a RAM cache of <split_dir>'s decoded images would take: the first image's x the image count."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    files = [
        Path(c.path) / f
        for c in sorted(os.scandir(split_dir), key=lambda e: e.name)
        if c.is_dir()
        for f in sorted(os.listdir(c.path))
        if f.lower().endswith(IMG_EXTENSIONS)
    ]
    return decode_rgb(files[0]).numel() * len(files) if files else 0


def class_folders(split_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
