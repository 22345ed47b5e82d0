"""Corpus building, caching and input errors, on small temporary folders.

Checked: tokens and offsets equal the files' bytes; a second load is a cache hit that reads no file; a changed
or added file, or other settings, rebuild; JSONL and pre-tokenized inputs; every input error raises or warns
with the path and the fix; the default Python-source corpus builds (with a small cap) deterministically.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from lightning_paradyse.data.corpus import (
    ByteTokenizer,
    CorpusConfig,
    TokenCorpus,
    cache_path,
    check_vocab,
    corpus_tables,
    list_inputs,
    load_corpus,
    split_documents,
    write_token_corpus,
)

DOCS = {"a.txt": b"hello world\n", "sub/b.txt": b"x" * 300, "sub/deeper/c.md": "caf\u00e9 na\u00efve\n".encode()}


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def folder_config(tmp_path: Path, **kw: object) -> CorpusConfig:
    data = tmp_path / "data"
    if not data.exists():
        make_folder(data, DOCS)
    args = {"source": "folder", "path": str(data), "cache_dir": str(tmp_path / "cache"), "verbose": False, **kw}
    return CorpusConfig(**args)  # type: ignore[arg-type]


def test_folder_corpus_tokens_and_offsets(tmp_path: Path) -> None:
    corpus = load_corpus(folder_config(tmp_path, extensions=(".txt", ".md")))
    expected = [DOCS[k] for k in sorted(DOCS, key=lambda k: str(tmp_path / "data" / k))]
    assert len(corpus) == 3 and corpus.vocab_size == 256
    assert corpus.lengths.tolist() == [len(d) for d in expected]
    assert corpus.offsets.tolist() == [0, *np.cumsum([len(d) for d in expected]).tolist()]
    for i, data in enumerate(expected):
        assert bytes(corpus[i].tolist()) == data
    assert corpus.span(1, 2, 5).tolist() == list(expected[1][2:5])
    assert corpus.max_token_id == max(max(d) for d in expected)
    assert not corpus.info.cache_hit and corpus.info.files_read == 3


def test_extensions_filter(tmp_path: Path) -> None:
    corpus = load_corpus(folder_config(tmp_path, extensions=(".md",)))
    assert len(corpus) == 1


def test_second_load_is_a_cache_hit_and_changes_rebuild(tmp_path: Path) -> None:
    config = folder_config(tmp_path)
    first = load_corpus(config)
    again = load_corpus(config)
    assert again.info.cache_hit and again.info.files_read == 0
    assert again.path == first.path and again.lengths.tolist() == first.lengths.tolist()

    (tmp_path / "data" / "a.txt").write_bytes(b"changed and longer\n")
    changed = load_corpus(config)
    assert not changed.info.cache_hit and changed.info.files_read == 3
    assert bytes(changed[0].tolist()) == b"changed and longer\n"

    stamp = os.stat(tmp_path / "data" / "a.txt").st_mtime_ns
    os.utime(tmp_path / "data" / "a.txt", ns=(stamp + 10**9, stamp + 10**9))  # same size, newer mtime
    assert not load_corpus(config).info.cache_hit

    (tmp_path / "data" / "new.txt").write_bytes(b"a new document")
    added = load_corpus(config)
    assert not added.info.cache_hit and len(added) == 4
    assert load_corpus(config).info.cache_hit


def test_settings_get_their_own_cache(tmp_path: Path) -> None:
    plain, eod = folder_config(tmp_path), folder_config(tmp_path, eod=True, ascii=True)
    assert cache_path(plain) != cache_path(eod)
    corpus = load_corpus(eod)
    assert corpus.vocab_size == 129 and corpus.max_token_id == 128
    doc = corpus[2].tolist()  # "café naïve\n": non-ASCII bytes clipped to 127, then the end-of-document id
    assert doc[-1] == 128 and max(doc[:-1]) == 127 and len(doc) == len(DOCS["sub/deeper/c.md"]) + 1
    assert not load_corpus(plain).info.cache_hit  # built apart, and both stay cached
    assert load_corpus(eod).info.cache_hit and load_corpus(plain).info.cache_hit


def test_tokenizer() -> None:
    tok = ByteTokenizer(eod=True)
    ids = tok.encode("né".encode())
    assert ids.tolist() == [110, 195, 169, 256] and tok.vocab_size == 257
    assert tok.decode(ids) == "né"
    assert ByteTokenizer(ascii=True).vocab_size == 128


def test_jsonl_corpus(tmp_path: Path) -> None:
    lines = [{"body": "first"}, {"body": ""}, {"body": "third document"}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    with pytest.warns(UserWarning, match=r"skipped 1 input\(s\) that are empty: .*docs.jsonl:2"):
        corpus = load_corpus(
            CorpusConfig("jsonl", str(path), text_field="body", cache_dir=str(tmp_path), verbose=False)
        )
    assert [bytes(corpus[i].tolist()) for i in range(len(corpus))] == [b"first", b"third document"]
    capped = CorpusConfig("jsonl", str(path), text_field="body", max_bytes=10, cache_dir=str(tmp_path), verbose=False)
    with pytest.warns(UserWarning):
        assert len(load_corpus(capped)) == 1


def test_jsonl_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    config = CorpusConfig("jsonl", str(path), cache_dir=str(tmp_path), verbose=False)
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON .* fix or remove the line"):
        load_corpus(config)
    assert not list(cache_path(config).glob("*.tmp"))  # a failed build leaves no temporary file
    path.write_text('{"content": "no text key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no string field 'text' \(found \['content'\]\); set "):
        load_corpus(config)
    path.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"empty corpus: .*bad.jsonl .*1 empty"):
        load_corpus(config)


def test_token_file_corpus(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [], [700, 5], [9]]
    write_token_corpus(tmp_path / "tok", docs, vocab_size=1000)
    corpus = load_corpus(CorpusConfig("tokens", str(tmp_path / "tok")))
    assert corpus.tokens.dtype == np.uint16 and corpus.vocab_size == 1000 and corpus.max_token_id == 700
    assert [corpus[i].tolist() for i in range(len(corpus))] == [[1, 2, 3], [700, 5], [9]]
    with pytest.raises(ValueError, match=r"ids must lie in 0\.\.9"):
        write_token_corpus(tmp_path / "bad", [[3, 10]], vocab_size=10)


def test_token_file_with_empty_documents_and_corruption(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    write_token_corpus(folder, [[1, 2], [3]], vocab_size=4)
    np.save(folder / "offsets.npy", np.array([0, 2, 2, 3], dtype=np.int64))
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "n_docs": 3}))
    with pytest.warns(UserWarning, match="skipped 1 empty document"):
        corpus = load_corpus(CorpusConfig("tokens", str(folder)))
    assert [corpus[i].tolist() for i in range(len(corpus))] == [[1, 2], [3]]
    assert pickle.loads(pickle.dumps(corpus))[1].tolist() == [3]  # what a DataLoader worker sees
    (folder / "tokens.bin").write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"corrupt token corpus: tokens.bin has 1 bytes, expected 3 x 1; delete"):
        load_corpus(CorpusConfig("tokens", str(folder)))
    (folder / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"manifest.json not found: .*write_token_corpus"):
        load_corpus(CorpusConfig("tokens", str(folder)))


def test_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"corpus path .*nowhere does not exist .*fix the path"):
        load_corpus(CorpusConfig("folder", str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"needs path="):
        load_corpus(CorpusConfig("jsonl"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"data")
    with pytest.raises(ValueError, match=r"empty corpus: no file under .*d ends with one of \['.txt'"):
        load_corpus(CorpusConfig("folder", str(tmp_path / "d"), extensions=(".txt",)))
    (tmp_path / "d" / "empty.txt").write_bytes(b"")
    config = CorpusConfig("folder", str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), verbose=False)
    with pytest.raises(ValueError, match=r"empty corpus: .*1 empty.*add documents"):
        load_corpus(config)


def test_unreadable_and_non_utf8_files_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_folder(tmp_path / "data", {"bad.txt": b"\xff\xfe binary", "locked.txt": b"secret", "ok.txt": b"fine"})
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.warns(UserWarning) as record:
        corpus = load_corpus(folder_config(tmp_path))
    messages = " ".join(str(w.message) for w in record)
    assert "1 input(s) that could not be read: " in messages and "locked.txt" in messages
    assert "1 input(s) that are not UTF-8 text: " in messages and "bad.txt" in messages
    assert [bytes(corpus[i].tolist()) for i in range(len(corpus))] == [b"fine"]
    assert corpus.info.skipped.keys() == {"unreadable", "not_utf8"}
    with pytest.warns(UserWarning, match="could not be read"):
        assert len(load_corpus(folder_config(tmp_path, require_utf8=False))) == len(corpus) + 1


def test_check_vocab_names_ids(tmp_path: Path) -> None:
    corpus = load_corpus(folder_config(tmp_path))
    check_vocab(corpus, 256)
    with pytest.raises(
        ValueError, match=r"id 195 .* vocabulary has 128 \(ids 0\.\.127\); use a model with vocab_size >= 196"
    ):
        check_vocab(corpus, 128)


def test_default_python_corpus_small_cap(tmp_path: Path) -> None:
    config = CorpusConfig(max_bytes=300_000, cache_dir=str(tmp_path), verbose=False)
    files = list_inputs(config)
    assert files == sorted(files, key=lambda f: f.path)  # deterministic: the later cache hit re-lists them
    assert 0 < sum(f.size for f in files) <= 300_000 and all(f.path.endswith(".py") and f.size for f in files)
    corpus = load_corpus(config)
    assert len(corpus) >= 1 and load_corpus(config).info.cache_hit
    tables = corpus_tables(corpus)
    assert len(tables) == 4 and sum(tables[1].percents) == pytest.approx(100.0)


def test_split_and_pickle(tmp_path: Path) -> None:
    train, val = split_documents(10, 0.2, seed=1)
    assert len(val) == 2 and sorted([*train, *val]) == list(range(10))
    assert np.array_equal(val, split_documents(10, 0.2, seed=1)[1])
    corpus = load_corpus(folder_config(tmp_path))
    clone = pickle.loads(pickle.dumps(corpus))
    assert isinstance(clone, TokenCorpus) and clone[1].tolist() == corpus[1].tolist()
    assert len(pickle.dumps(corpus)) < 4000  # the memmap is reopened, not copied
