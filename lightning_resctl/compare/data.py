"""Char-level text data for the main job: corpora, a char vocabulary, and a LightningDataModule.

Corpora (all split into train / validation deterministically):

* :func:`stdlib_corpus` — the default: the Python standard library's own ``*.py`` files
  (top level of ``sysconfig.get_paths()["stdlib"]``), present on every machine without a
  download. Split **by file**: files are sorted by name and every ``val_every``-th file goes
  to validation, so no file contributes to both splits. Each split is capped (whole files,
  in sorted order) at ``max_train_chars`` / ``max_val_chars``. The exact text depends on the
  Python version installed; :attr:`CharCorpus.source` says which.
* :func:`text_corpus` — ``--text PATH``: one file (its last ``val_fraction`` of characters is
  validation) or a directory (its text files, split by file like the default).
* :func:`hf_corpus` — ``--hf-dataset NAME``: a Hugging Face dataset (``datasets`` is imported
  lazily; a clear error when it is missing or the hub cannot be reached).

:class:`CharDataModule` draws training windows at offsets fixed by ``seed`` alone (a private
``torch.Generator``), so every method trained with the same seed sees the same batches in the
same order; validation windows are fixed, evenly spaced and identical for every seed.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["CharVocab", "CharCorpus", "stdlib_corpus", "text_corpus", "hf_corpus", "load_corpus",
           "CharDataModule"]

_FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class CharVocab:
    """Sorted characters; ``encode`` maps text to a LongTensor of indices, ``decode`` back."""

    chars: tuple[str, ...]

    @classmethod
    def from_texts(cls, *texts: str) -> "CharVocab":
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars:
            raise ValueError("cannot build a vocabulary from empty text")
        return cls(tuple(sorted(chars)))

    def __len__(self) -> int:
        return len(self.chars)

    @property
    def stoi(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.fromiter((ord(c) for c in self.chars), dtype=np.uint32, count=len(self.chars))
        ids = np.searchsorted(table, codes)  # chars are sorted, so code points are too
        ids = np.minimum(ids, len(table) - 1)
        bad = table[ids] != codes
        if bad.any():
            raise ValueError(f"character {chr(codes[bad][0])!r} is not in the vocabulary")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class CharCorpus:
    """Encoded train / validation splits with their vocabulary and a description of the source."""

    train: torch.Tensor
    val: torch.Tensor
    vocab: CharVocab
    source: str
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)

    @classmethod
    def from_texts(cls, train_text: str, val_text: str, source: str, **files) -> "CharCorpus":
        if not train_text:
            raise ValueError(f"the training split of {source} is empty")
        if not val_text:
            raise ValueError(f"the validation split of {source} is empty")
        vocab = CharVocab.from_texts(train_text, val_text)
        return cls(vocab.encode(train_text), vocab.encode(val_text), vocab, source, **files)

    def describe(self) -> str:
        return (f"{self.source}: {len(self.train):,} train chars"
                f"{f' ({len(self.train_files)} files)' if self.train_files else ''}, "
                f"{len(self.val):,} validation chars"
                f"{f' ({len(self.val_files)} files)' if self.val_files else ''}, vocabulary {len(self.vocab)}")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _split_files(files: list[Path], val_every: int, max_train_chars: int | None,
                 max_val_chars: int | None, source: str) -> CharCorpus:
    """Sorted files; file i goes to validation when ``i % val_every == val_every - 1``; caps are
    applied in whole files, in sorted order (a split stops before the file that would pass its cap,
    but always holds at least one file)."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every!r}")
    files = sorted(files, key=lambda p: p.name)
    if len(files) < 2:
        raise ValueError(f"{source}: need at least 2 files to split by file, found {len(files)}")
    splits: dict[str, list[str]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    caps = {"train": max_train_chars, "val": max_val_chars}
    for i, path in enumerate(files):
        split = "val" if i % val_every == val_every - 1 else "train"
        cap = caps[split]
        if cap is not None and splits[split] and sizes[split] >= cap:
            continue
        text = _read(path)
        if not text.strip():
            continue
        if cap is not None and splits[split] and sizes[split] + len(text) > cap:
            continue
        splits[split].append(text)
        names[split].append(path.name)
        sizes[split] += len(text) + len(_FILE_SEPARATOR)
    return CharCorpus.from_texts(_FILE_SEPARATOR.join(splits["train"]), _FILE_SEPARATOR.join(splits["val"]),
                                 source, train_files=names["train"], val_files=names["val"])


def stdlib_corpus(max_train_chars: int | None = 2_000_000, max_val_chars: int | None = 250_000,
                  val_every: int = 10, stdlib_dir: str | os.PathLike | None = None) -> CharCorpus:
    """The default corpus: the standard library's top-level ``*.py`` sources, split by file."""
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py") if p.is_file()]
    if len(files) < 2:
        raise FileNotFoundError(
            f"found {len(files)} Python source files in the standard library folder {root}; "
            "pass --text PATH (a text file or folder) to use your own corpus")
    return _split_files(files, val_every, max_train_chars, max_val_chars,
                        source=f"Python standard library sources ({root})")


_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".csv", ".tex", ".html", ".xml", ""}


def text_corpus(path: str | os.PathLike, val_fraction: float = 0.1, val_every: int = 10,
                max_train_chars: int | None = None, max_val_chars: int | None = None) -> CharCorpus:
    """The user's text: a file (the last ``val_fraction`` of its characters is validation)
    or a folder (its text files, recursively, split by file every ``val_every``-th)."""
    p = Path(path)
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES]
        return _split_files(files, val_every, max_train_chars, max_val_chars, source=f"text folder {p}")
    if not p.is_file():
        raise FileNotFoundError(f"--text: no such file or folder: {str(p)!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    text = _read(p)
    cut = int(len(text) * (1.0 - val_fraction))
    train, val = text[:cut], text[cut:]
    if max_train_chars is not None:
        train = train[:max_train_chars]
    if max_val_chars is not None:
        val = val[:max_val_chars]
    return CharCorpus.from_texts(train, val, source=f"text file {p}")


def hf_corpus(name: str, config: str | None = None, text_field: str = "text", train_split: str = "train",
              val_split: str | None = "validation", val_fraction: float = 0.1,
              max_train_chars: int | None = 2_000_000, max_val_chars: int | None = 250_000) -> CharCorpus:
    """A Hugging Face dataset's ``text_field`` column (streamed; capped at the char limits).

    When ``val_split`` is missing from the dataset, the last ``val_fraction`` of the training
    characters is used. Needs the ``datasets`` package and network access to the hub."""
    try:
        import datasets  # noqa: PLC0415  (optional dependency, imported lazily)
    except ImportError as err:
        raise ImportError("--hf-dataset needs the 'datasets' package: pip install datasets "
                          "(or use the default corpus, or --text PATH)") from err

    def take(split: str, limit: int | None) -> str:
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
        parts, size = [], 0
        for row in stream:
            if text_field not in row:
                raise KeyError(f"--hf-dataset {name!r}: rows have no field {text_field!r} "
                               f"(fields: {sorted(row)}); pass --hf-text-field")
            parts.append(str(row[text_field]))
            size += len(parts[-1]) + 1
            if limit is not None and size >= limit:
                break
        return "\n".join(parts)[:limit] if limit is not None else "\n".join(parts)

    try:
        train = take(train_split, None if max_train_chars is None else max_train_chars
                     + (max_val_chars or 0))
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
            "or --text PATH.") from err
    if not val:
        cut = int(len(train) * (1.0 - val_fraction))
        train, val = train[:cut], train[cut:]
    if max_train_chars is not None:
        train = train[:max_train_chars]
    return CharCorpus.from_texts(train, val, source=f"Hugging Face dataset {name}"
                                                    f"{'/' + config if config else ''}")


def load_corpus(text: str | os.PathLike | None = None, hf_dataset: str | None = None,
                max_train_chars: int | None = 2_000_000, max_val_chars: int | None = 250_000,
                **hf_options) -> CharCorpus:
    """Pick the corpus from the command-line options: ``text`` or ``hf_dataset`` (not both), else the stdlib."""
    if text is not None and hf_dataset is not None:
        raise ValueError("give at most one of --text and --hf-dataset")
    if text is not None:
        return text_corpus(text, max_train_chars=max_train_chars, max_val_chars=max_val_chars)
    if hf_dataset is not None:
        return hf_corpus(hf_dataset, max_train_chars=max_train_chars, max_val_chars=max_val_chars, **hf_options)
    return stdlib_corpus(max_train_chars=max_train_chars, max_val_chars=max_val_chars)


class _WindowBatches(Dataset):
    """Item i is one whole batch: ``x = data[o : o + T]``, ``y = data[o + 1 : o + T + 1]`` for the
    batch's offsets ``offsets[i]`` (shape (B,))."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, block_size: int):
        self.data = data
        self.offsets = offsets
        self.arange = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return self.offsets.size(0)

    def __getitem__(self, i: int):
        windows = self.data[self.offsets[i].unsqueeze(1) + self.arange]
        return windows[:, :-1], windows[:, 1:]


class CharDataModule(L.LightningDataModule):
    """Fixed-order char windows of length ``block_size``.

    Training: ``train_steps`` batches of ``batch_size`` windows at offsets drawn uniformly from a
    ``torch.Generator`` seeded with ``seed`` (same seed => same batches, same order, whatever the
    global RNG state). Validation: ``val_batches`` batches of windows evenly spaced over the
    validation split (independent of the seed; fewer if the split is short).
    """

    def __init__(self, corpus: CharCorpus, block_size: int = 64, batch_size: int = 32,
                 train_steps: int = 100, val_batches: int = 4, seed: int = 0):
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size),
                            ("train_steps", train_steps), ("val_batches", val_batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for split in ("train", "val"):
            n = len(getattr(corpus, split))
            if n < block_size + 2:
                raise ValueError(f"the {split} split has {n} characters, fewer than block_size + 2 "
                                 f"= {block_size + 2}: use a longer text or a smaller --block-size")
        self.corpus = corpus
        self.block_size = block_size
        self.batch_size = batch_size
        self.train_steps = train_steps
        self.val_batches = val_batches
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return len(self.corpus.vocab)

    def train_offsets(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(self.seed))
        high = len(self.corpus.train) - self.block_size - 1
        return torch.randint(0, high + 1, (self.train_steps, self.batch_size), generator=generator)

    def val_offsets(self) -> torch.Tensor:
        high = len(self.corpus.val) - self.block_size - 1
        count = min(self.val_batches * self.batch_size, high + 1)
        offsets = torch.linspace(0, high, count).long()
        usable = (count // self.batch_size) * self.batch_size
        if usable == 0:  # short validation text: one smaller batch
            return offsets.unsqueeze(0)
        return offsets[:usable].view(-1, self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_WindowBatches(self.corpus.train, self.train_offsets(), self.block_size),
                          batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_WindowBatches(self.corpus.val, self.val_offsets(), self.block_size),
                          batch_size=None, shuffle=False)
