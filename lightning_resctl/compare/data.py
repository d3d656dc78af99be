"""The built-in data of the compare job: a byte-level text corpus and :class:`CharDataModule`.

Corpora (each split into train / validation deterministically):

* the default: the Python standard library's own ``*.py`` files (top level of
  ``sysconfig.get_paths()["stdlib"]``), present on every machine without a download. Split **by file**:
  files sorted by name, every ``val_every``-th file is validation, so no file is in both splits; each split
  is capped in whole files (sorted order) at ``max_train_chars`` / ``max_val_chars``. The text depends on the
  installed Python version, which the description names (e.g. "Python 3.11.7 standard library, 152 + 16
  files");
* ``text=PATH``: one file (its last ``val_fraction`` of characters is validation) or a folder (its text
  files, recursively, split by file like the default);
* ``hf_dataset=NAME``: a Hugging Face dataset (``datasets`` is imported lazily; a clear error when it is
  missing or the hub cannot be reached).

Text is encoded as UTF-8 bytes: the vocabulary is the 256 byte values whatever the corpus (one token per
character for ASCII text such as Python sources), so the model's size does not depend on the data.
Descriptions name files and folders without their machine paths.
"""
from __future__ import annotations

import functools
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["VOCAB_SIZE", "encode", "decode", "CharCorpus", "stdlib_corpus", "text_corpus", "hf_corpus",
           "load_corpus", "CharDataModule"]

#: The vocabulary of the built-in data: byte values.
VOCAB_SIZE = 256
_FILE_SEPARATOR = "\n\n"


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a uint8 tensor (one token per byte)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(ids) -> str:
    """The text of byte values ``ids`` (invalid UTF-8 sequences replaced)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass
class CharCorpus:
    """Encoded train / validation splits (uint8 tensors) and a description of the source without machine paths."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)

    @classmethod
    def from_texts(cls, train_text: str, val_text: str, source: str, **files) -> "CharCorpus":
        if not train_text:
            raise ValueError(f"the training split of {source} is empty")
        if not val_text:
            raise ValueError(f"the validation split of {source} is empty")
        return cls(encode(train_text), encode(val_text), source, **files)

    def describe(self) -> str:
        """E.g. ``"Python 3.11.7 standard library, 152 + 16 files: 2,000,000 train bytes, 250,000 validation
        bytes"``."""
        return f"{self.source}: {len(self.train):,} train bytes, {len(self.val):,} validation bytes"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _split_files(files: list[Path], val_every: int, max_train_chars: int | None, max_val_chars: int | None,
                 source: str) -> CharCorpus:
    """Sorted files; file i goes to validation when ``i % val_every == val_every - 1``; caps are applied in whole
    files, in sorted order (a split skips a file that would pass its cap, but always holds at least one file)."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every!r}")
    files = sorted(files, key=lambda p: p.name)
    if len(files) < 2:
        raise ValueError(f"{source}: need at least 2 files to split by file, found {len(files)}")
    texts: dict[str, list[str]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    caps = {"train": max_train_chars, "val": max_val_chars}
    for i, path in enumerate(files):
        split = "val" if i % val_every == val_every - 1 else "train"
        cap = caps[split]
        text = _read(path)
        if not text.strip():
            continue
        if cap is not None and texts[split] and sizes[split] + len(text) > cap:
            continue
        texts[split].append(text)
        names[split].append(path.name)
        sizes[split] += len(text) + len(_FILE_SEPARATOR)
    described = f"{source}, {len(names['train'])} + {len(names['val'])} files"
    return CharCorpus.from_texts(_FILE_SEPARATOR.join(texts["train"]), _FILE_SEPARATOR.join(texts["val"]),
                                 described, train_files=names["train"], val_files=names["val"])


def stdlib_corpus(max_train_chars: int | None = 2_000_000, max_val_chars: int | None = 250_000,
                  val_every: int = 10, stdlib_dir: str | os.PathLike | None = None) -> CharCorpus:
    """The default corpus: the standard library's top-level ``*.py`` sources, split by file."""
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py") if p.is_file()]
    if len(files) < 2:
        raise FileNotFoundError(
            f"found {len(files)} Python source files in the standard library folder {root}; "
            "pass text=PATH (a text file or folder) to use your own corpus")
    source = (f"Python {platform.python_version()} standard library" if stdlib_dir is None
              else f"Python sources of the folder {root.name}/")
    return _split_files(files, val_every, max_train_chars, max_val_chars, source=source)


_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".csv", ".tex", ".html", ".xml", ""}


def text_corpus(path: str | os.PathLike, val_fraction: float = 0.1, val_every: int = 10,
                max_train_chars: int | None = None, max_val_chars: int | None = None) -> CharCorpus:
    """The user's text: a file (its last ``val_fraction`` of characters is validation) or a folder (its text
    files, recursively, split by file every ``val_every``-th)."""
    p = Path(path)
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES]
        return _split_files(files, val_every, max_train_chars, max_val_chars, source=f"text folder {p.name}/")
    if not p.is_file():
        raise FileNotFoundError(f"text: no such file or folder: {str(p)!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    text = _read(p)
    cut = int(len(text) * (1.0 - val_fraction))
    train, val = text[:cut], text[cut:]
    if max_train_chars is not None:
        train = train[:max_train_chars]
    if max_val_chars is not None:
        val = val[:max_val_chars]
    return CharCorpus.from_texts(train, val, source=f"text file {p.name}")


def hf_corpus(name: str, config: str | None = None, text_field: str = "text", train_split: str = "train",
              val_split: str | None = "validation", val_fraction: float = 0.1,
              max_train_chars: int | None = 2_000_000, max_val_chars: int | None = 250_000) -> CharCorpus:
    """A Hugging Face dataset's ``text_field`` column (streamed; capped at the char limits).

    When ``val_split`` is missing from the dataset, the last ``val_fraction`` of the training characters is
    used. Needs the ``datasets`` package and network access to the hub."""
    try:
        import datasets  # noqa: PLC0415  (optional dependency, imported lazily)
    except ImportError as err:
        raise ImportError("hf_dataset needs the 'datasets' package: pip install datasets "
                          "(or use the default corpus, or text=PATH)") from err

    def take(split: str, limit: int | None) -> str:
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
        parts, size = [], 0
        for row in stream:
            if text_field not in row:
                raise KeyError(f"hf_dataset {name!r}: rows have no field {text_field!r} "
                               f"(fields: {sorted(row)}); set hf_text_field")
            parts.append(str(row[text_field]))
            size += len(parts[-1]) + 1
            if limit is not None and size >= limit:
                break
        return "\n".join(parts)[:limit] if limit is not None else "\n".join(parts)

    try:
        train = take(train_split, None if max_train_chars is None else max_train_chars + (max_val_chars or 0))
        try:
            val = take(val_split, max_val_chars) if val_split else ""
        except (ValueError, KeyError):
            val = ""
    except (ImportError, KeyError):
        raise
    except Exception as err:  # network / hub errors come in many types
        raise RuntimeError(
            f"could not load the Hugging Face dataset {name!r} ({type(err).__name__}: {err}). "
            "Is the network reachable (HF_HUB_OFFLINE unset)? Without it, use the default corpus "
            "or text=PATH.") from err
    if not val:
        cut = int(len(train) * (1.0 - val_fraction))
        train, val = train[:cut], train[cut:]
    if max_train_chars is not None:
        train = train[:max_train_chars]
    return CharCorpus.from_texts(train, val, source=f"Hugging Face dataset {name}{'/' + config if config else ''}")


@functools.lru_cache(maxsize=4)
def load_corpus(text: str | None = None, hf_dataset: str | None = None, hf_config: str | None = None,
                hf_text_field: str = "text", max_train_chars: int | None = 2_000_000,
                max_val_chars: int | None = 250_000) -> CharCorpus:
    """The corpus of these options (``text`` or ``hf_dataset``, not both; else the standard library), read once per
    process."""
    if text is not None and hf_dataset is not None:
        raise ValueError(f"give at most one of text and hf_dataset, got text={text!r} and hf_dataset={hf_dataset!r}")
    if text is not None:
        return text_corpus(text, max_train_chars=max_train_chars, max_val_chars=max_val_chars)
    if hf_dataset is not None:
        return hf_corpus(hf_dataset, hf_config, hf_text_field, max_train_chars=max_train_chars,
                         max_val_chars=max_val_chars)
    return stdlib_corpus(max_train_chars=max_train_chars, max_val_chars=max_val_chars)


class _Windows(Dataset):
    """Item i: ``x = data[o : o + T]``, ``y = data[o + 1 : o + T + 1]`` (int64) at offset ``o = offsets[i]``."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, block_size: int):
        self.data, self.offsets, self.block_size = data, offsets, block_size

    def __len__(self) -> int:
        return int(self.offsets.numel())

    def __getitem__(self, i: int):
        o = int(self.offsets[i])
        window = self.data[o:o + self.block_size + 1].long()
        return window[:-1], window[1:]


class CharDataModule(L.LightningDataModule):
    """Byte-level next-token windows of ``block_size`` from a text corpus (see the module docstring).

    Training: every offset of the training split is one window, shuffled by a standard ``DataLoader``
    (``shuffle=True``), so the order follows the global seed (``seed_everything``) as for any Lightning data.
    Validation: ``val_batches`` batches of windows evenly spaced over the validation split, the same for every
    seed.

    Args:
        text: your own text file or folder instead of the standard-library sources.
        hf_dataset, hf_config, hf_text_field: a Hugging Face dataset instead (needs ``datasets`` and network).
        max_train_chars, max_val_chars: caps on each split (whole files for folders).
        block_size: window length T (the model's context must be at least this).
        batch_size: windows per batch.
        val_batches: batches per validation.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, text: str | None = None, hf_dataset: str | None = None, hf_config: str | None = None,
                 hf_text_field: str = "text", max_train_chars: int | None = 2_000_000,
                 max_val_chars: int | None = 250_000, block_size: int = 64, batch_size: int = 32,
                 val_batches: int = 3, num_workers: int = 0):
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("val_batches", val_batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if text is not None and hf_dataset is not None:
            raise ValueError(f"give at most one of text and hf_dataset, got text={text!r} and "
                             f"hf_dataset={hf_dataset!r}")
        self.save_hyperparameters()
        self.corpus: CharCorpus | None = None

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def describe(self) -> str:
        """The corpus, without machine paths (loads it if needed)."""
        self.setup("fit")
        return self.corpus.describe()

    def setup(self, stage: str) -> None:
        if self.corpus is not None:
            return
        hp = self.hparams
        corpus = load_corpus(hp.text, hp.hf_dataset, hp.hf_config, hp.hf_text_field, hp.max_train_chars,
                             hp.max_val_chars)
        for split in ("train", "val"):
            n = len(getattr(corpus, split))
            if n < hp.block_size + 2:
                raise ValueError(f"the {split} split of {corpus.source} has {n} bytes, fewer than block_size + 2 "
                                 f"= {hp.block_size + 2}: use a longer text or a smaller block_size")
        self.corpus = corpus

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        offsets = torch.arange(len(self.corpus.train) - hp.block_size)
        return DataLoader(_Windows(self.corpus.train, offsets, hp.block_size), batch_size=hp.batch_size,
                          shuffle=True, drop_last=True, num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        high = len(self.corpus.val) - hp.block_size - 1
        count = max(1, min(hp.val_batches * hp.batch_size, high + 1))
        offsets = torch.linspace(0, high, count).long()
        return DataLoader(_Windows(self.corpus.val, offsets, hp.block_size), batch_size=hp.batch_size,
                          shuffle=False, num_workers=hp.num_workers)
