"""Token corpora on disk: a default corpus that needs no download, user text, and pre-tokenized files.

Why: variable-length training needs real documents with a natural long tail of lengths. Every machine that
runs this project has one: the Python source files of the standard library and of the installed packages,
code like the paper's GitHubCode. :func:`load_corpus` turns that (or a folder of text files, or a JSONL file)
into tokens once, caches them on disk and memory-maps them afterwards.

Tokenizer: :class:`ByteTokenizer`, byte-level (no download). A document's UTF-8 bytes are its token ids
(vocabulary 256); ``ascii=True`` clips bytes >= 128 to 127 (vocabulary 128, for the tiny test models);
``eod=True`` appends an end-of-document id equal to the byte vocabulary (256 or 128), growing it by one.

On-disk format (the cache and the pre-tokenized input share it), a folder holding:

* ``tokens.bin``: every document's tokens, concatenated, raw little-endian integers of the manifest's ``dtype``;
* ``offsets.npy``: int64 ``[n_docs + 1]``, document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``;
* ``manifest.json``: ``format``, ``dtype``, ``vocab_size``, ``n_docs``, ``n_tokens``, ``max_token_id``,
  and for a cache the ``fingerprint`` of its inputs plus build statistics.

:func:`write_token_corpus` writes this format from any token lists. The cache lives in
``<cache_dir>/<source>-<hash of the settings>/`` and is rebuilt when the fingerprint (the sorted
``(path, size, mtime)`` of every input file and the builder settings) changes. Build it from one process
(a DataModule's ``prepare_data``); the files are replaced by renames, the manifest last.

Problems with the input, decided once:

* a missing path: ``FileNotFoundError``; no document left (no matching file, every file unreadable or
  empty): ``ValueError`` naming the path, the counts and the fix;
* an unreadable file (``OSError``, e.g. permissions) or, with ``require_utf8``, a file that is not UTF-8
  text (binary, latin-1): skipped, counted, one warning per kind naming the first paths;
* an empty document (0 bytes, empty JSONL text, equal consecutive offsets): skipped, counted, one warning;
* a malformed JSONL line or a missing/non-string text field: ``ValueError`` with ``path:line`` (data files
  are fixed, not silently thinned);
* token ids beyond a model's vocabulary: :func:`check_vocab` raises naming the largest id.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightning_paradyse.data.length_traces import (
    LengthTable,
    bucket_labels,
    length_table,
    markdown_table,
    paper_table,
    scaled_edges,
)

FORMAT = "lightning_paradyse.corpus/1"
"""The ``format`` entry of every manifest this module writes."""
TOKENS_FILE, OFFSETS_FILE, MANIFEST_FILE = "tokens.bin", "offsets.npy", "manifest.json"
DEFAULT_PYTHON_BYTES = 32 * 2**20
"""Default cap of the Python-source corpus: 32 MiB of source (a few thousand files)."""

Source = Literal["python", "folder", "jsonl", "tokens"]


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes as token ids; no vocabulary file, no download."""

    ascii: bool = False
    """Clip bytes >= 128 to 127: vocabulary 128 instead of 256 (non-ASCII text loses information)."""
    eod: bool = False
    """Append an end-of-document id (:attr:`eod_id`) to every document; the vocabulary grows by one."""

    @property
    def eod_id(self) -> int:
        """The end-of-document id: the first id after the bytes (128 or 256)."""
        return 128 if self.ascii else 256

    @property
    def vocab_size(self) -> int:
        """Number of ids: 128 or 256, plus one with ``eod``."""
        return self.eod_id + int(self.eod)

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of ``data`` (uint8, or uint16 with ``eod``)."""
        ids = np.frombuffer(data, dtype=np.uint8)
        if self.ascii:
            ids = np.minimum(ids, 127)
        if not self.eod:
            return ids.copy()
        return np.concatenate([ids.astype(np.uint16), np.array([self.eod_id], dtype=np.uint16)])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (the end-of-document id is dropped, invalid UTF-8 replaced)."""
        return bytes(i for i in (int(x) for x in ids) if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class CorpusConfig:
    """Where the documents come from and how they are tokenized and cached."""

    source: Source = "python"
    """``python``: the ``*.py`` files of the standard library and installed packages (default, no download);
    ``folder``: text files under ``path``; ``jsonl``: one JSON object per line of ``path``;
    ``tokens``: a pre-tokenized folder at ``path`` in the on-disk format (used in place, not cached)."""
    path: str | None = None
    """The folder, JSONL file or token folder; for ``python`` extra roots are not supported: leave ``None``."""
    extensions: tuple[str, ...] = (".txt", ".md", ".rst", ".py")
    """``folder``: file name endings to read (searched recursively); ``python`` always reads ``.py``."""
    text_field: str = "text"
    """``jsonl``: the key holding each document's text."""
    max_bytes: int | None = None
    """Cap on source bytes read. ``None``: :data:`DEFAULT_PYTHON_BYTES` for ``python``, everything otherwise.
    Files are sampled in a fixed pseudo-random order (hash of the path) until the next one would pass the
    cap; ``jsonl`` stops at the line that would pass it."""
    ascii: bool = False
    """Tokenizer: clip bytes to 7 bits, vocabulary 128 (see :class:`ByteTokenizer`)."""
    eod: bool = False
    """Tokenizer: append an end-of-document id to every document."""
    require_utf8: bool = True
    """Skip (and count) files that are not valid UTF-8 (binary or legacy-encoded files)."""
    cache_dir: str | None = None
    """Cache root; default ``$XDG_CACHE_HOME/lightning_paradyse`` or ``~/.cache/lightning_paradyse``."""
    progress: bool = True
    """Show a progress bar while building (only when stderr is a terminal)."""
    verbose: bool = True
    """Print the build time and the length-distribution table after a build."""

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer(ascii=self.ascii, eod=self.eod)


@dataclass
class BuildInfo:
    """What :func:`load_corpus` did."""

    cache_hit: bool
    """The cache was valid and no input file was read."""
    files_read: int = 0
    """Input files opened and read during this call."""
    skipped: dict[str, list[str]] = field(default_factory=dict)
    """Skipped inputs by reason (``unreadable``, ``not_utf8``, ``empty``): the paths (``path:line`` for JSONL)."""
    seconds: float = 0.0
    """Wall time of this call (listing, fingerprint, and the build on a miss)."""


class TokenCorpus:
    """Documents as one memory-mapped token array plus offsets. ``corpus[i]`` is document ``i`` as int64.

    Args:
        path: The folder in the on-disk format (see the module docstring).
        info: What built or loaded it (``None`` when opened directly).
    """

    def __init__(self, path: str | os.PathLike[str], info: BuildInfo | None = None) -> None:
        self.path = Path(path)
        self.info = info
        self.manifest = read_manifest(self.path)
        self.offsets, self.tokens = _open_arrays(self.path, self.manifest)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the memmap instead of copying it
        return {"path": self.path, "info": self.info, "manifest": self.manifest, "offsets": self.offsets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.info, self.manifest = state["path"], state["info"], state["manifest"]
        self.offsets = state["offsets"]  # kept: open_token_corpus may have dropped empty documents
        self.tokens = _open_arrays(self.path, self.manifest)[1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return torch.from_numpy(np.asarray(self.tokens[a:b], dtype=np.int64))

    def span(self, i: int, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start:stop`` of document ``i`` (int64) without reading the rest of it."""
        a = int(self.offsets[i])
        return torch.from_numpy(np.asarray(self.tokens[a + start : a + stop], dtype=np.int64))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document, int64 ``[n_docs]``."""
        return np.diff(self.offsets)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        """The vocabulary the corpus was tokenized with (from the manifest)."""
        return int(self.manifest["vocab_size"])

    @property
    def max_token_id(self) -> int:
        return int(self.manifest["max_token_id"])

    def __repr__(self) -> str:
        return f"TokenCorpus({str(self.path)!r}, docs={len(self)}, tokens={self.n_tokens}, vocab={self.vocab_size})"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a corpus folder, checked for the format and the required keys."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} not found: a token corpus is a folder with {TOKENS_FILE}, {OFFSETS_FILE} and {MANIFEST_FILE}; "
            f"write one with lightning_paradyse.data.corpus.write_token_corpus(path, docs, vocab_size)"
        )
    manifest = json.loads(file.read_text())
    missing = [k for k in ("format", "dtype", "vocab_size", "n_docs", "n_tokens") if k not in manifest]
    if manifest.get("format") != FORMAT or missing:
        raise ValueError(
            f"{file}: not a {FORMAT} manifest (format {manifest.get('format')!r}, missing keys {missing}); "
            f"rewrite the corpus with write_token_corpus"
        )
    return dict(manifest)


def _open_arrays(path: Path, manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, tokens memmap)``, checked against each other and the manifest."""
    dtype, n_tokens = np.dtype(manifest["dtype"]).newbyteorder("<"), int(manifest["n_tokens"])
    offsets = np.load(path / OFFSETS_FILE)
    size = (path / TOKENS_FILE).stat().st_size
    problem = None
    if offsets.ndim != 1 or len(offsets) != int(manifest["n_docs"]) + 1:
        problem = f"{OFFSETS_FILE} has shape {offsets.shape}, expected ({int(manifest['n_docs']) + 1},)"
    elif offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0):
        problem = f"{OFFSETS_FILE} must rise from 0 to n_tokens={n_tokens}"
    elif size != n_tokens * dtype.itemsize:
        problem = f"{TOKENS_FILE} has {size} bytes, expected {n_tokens} x {dtype.itemsize}"
    if problem:
        raise ValueError(f"{path}: corrupt token corpus: {problem}; delete the folder and rebuild or rewrite it")
    if n_tokens == 0:
        raise ValueError(f"{path}: the token corpus is empty (0 tokens); add documents and rewrite it")
    return offsets.astype(np.int64), np.memmap(path / TOKENS_FILE, dtype=dtype, mode="r", shape=(n_tokens,))


def check_vocab(corpus: TokenCorpus, vocab_size: int) -> None:
    """Raise ``ValueError`` if a token id of ``corpus`` does not fit a model with ``vocab_size`` embeddings."""
    if corpus.max_token_id >= vocab_size:
        raise ValueError(
            f"the corpus {corpus.path} holds token id {corpus.max_token_id} (its vocabulary has {corpus.vocab_size} "
            f"ids) but the model's vocabulary has {vocab_size} (ids 0..{vocab_size - 1}); use a model with "
            f"vocab_size >= {corpus.max_token_id + 1}, or a smaller tokenizer (CorpusConfig(ascii=True) gives 128 ids)"
        )


class _TokenWriter:
    """Streams documents into a corpus folder: temporary files, renamed into place by :meth:`finish`."""

    def __init__(self, path: Path, dtype: np.dtype[Any]) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.dtype, self.suffix = path, np.dtype(dtype).newbyteorder("<"), f".{os.getpid()}.tmp"
        self.file = open(path / (TOKENS_FILE + self.suffix), "wb")  # noqa: SIM115 (closed in finish)
        self.offsets, self.max_id = [0], -1

    def add(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        self.file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.offsets.append(self.offsets[-1] + int(ids.size))
        self.max_id = max(self.max_id, int(ids.max()))

    def abort(self) -> None:
        """Close and delete the temporary token file (the folder's previous contents stay)."""
        self.file.close()
        Path(self.file.name).unlink(missing_ok=True)

    def finish(self, vocab_size: int, extra: dict[str, Any]) -> dict[str, Any]:
        self.file.close()
        with open(self.path / (OFFSETS_FILE + self.suffix), "wb") as fh:  # np.save(path) would append ".npy"
            np.save(fh, np.asarray(self.offsets, dtype=np.int64))
        manifest = {
            "format": FORMAT,
            "dtype": self.dtype.name,
            "vocab_size": vocab_size,
            "n_docs": len(self.offsets) - 1,
            "n_tokens": self.offsets[-1],
            "max_token_id": self.max_id,
            **extra,
        }
        (self.path / (MANIFEST_FILE + self.suffix)).write_text(json.dumps(manifest, indent=1))
        for name in (TOKENS_FILE, OFFSETS_FILE, MANIFEST_FILE):  # manifest last: it marks the folder valid
            os.replace(self.path / (name + self.suffix), self.path / name)
        return manifest


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest unsigned dtype holding ids ``0..vocab_size - 1``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab_size {vocab_size} does not fit in 32 bits")


def write_token_corpus(
    path: str | os.PathLike[str], docs: Iterable[Sequence[int] | np.ndarray | torch.Tensor], vocab_size: int
) -> TokenCorpus:
    """Write pre-tokenized documents in the on-disk format (empty ones are dropped) and open the result."""
    writer = _TokenWriter(Path(path), token_dtype(vocab_size))
    for doc in docs:
        ids = np.asarray(doc.numpy() if isinstance(doc, torch.Tensor) else doc, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(
                f"write_token_corpus({path}): ids must lie in 0..{vocab_size - 1}, got {ids.min()}..{ids.max()}"
            )
        writer.add(ids)
    writer.finish(vocab_size, {"source": "write_token_corpus"})
    return TokenCorpus(path)


# ---------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputFile:
    """One input file and what the fingerprint records of it."""

    path: str
    size: int
    mtime_ns: int


def python_roots() -> list[Path]:
    """The standard library and the installed-packages folder (once, when one holds the other)."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]).resolve(), Path(paths["purelib"]).resolve()]
    return roots[:1] if roots[0] == roots[1] else roots


def _walk(root: Path, extensions: tuple[str, ...], skip: Sequence[Path] = ()) -> Iterator[InputFile]:
    """Files under ``root`` (recursively, no symlinked folders) whose names end with one of ``extensions``."""
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if here / d not in skip)
        for name in sorted(files):
            if name.endswith(extensions):
                try:
                    st = (here / name).stat()
                except OSError:
                    continue  # vanished or unreadable metadata: not an input
                yield InputFile(str(here / name), st.st_size, st.st_mtime_ns)


def _sample(files: list[InputFile], max_bytes: int | None) -> list[InputFile]:
    """A prefix of the files in hash-of-path order that fits ``max_bytes``, returned sorted by path."""
    if max_bytes is None or sum(f.size for f in files) <= max_bytes:
        return sorted(files, key=lambda f: f.path)
    keyed = sorted(files, key=lambda f: hashlib.blake2b(f.path.encode(), digest_size=8).digest())
    chosen, total = [], 0
    for f in keyed:
        if total + f.size > max_bytes:
            break
        chosen.append(f)
        total += f.size
    return sorted(chosen, key=lambda f: f.path)


def list_inputs(config: CorpusConfig) -> list[InputFile]:
    """The input files of ``config`` (sorted by path, capped), with size and mtime; raises when there are none."""
    if config.source == "python":
        if config.path is not None:
            raise ValueError(
                "CorpusConfig(source='python') reads the Python installation; use source='folder' for path"
            )
        roots = python_roots()
        files = [f for i, r in enumerate(roots) for f in _walk(r, (".py",), skip=roots[i + 1 :])]
        files = [f for f in files if f.size > 0]  # empty __init__.py files are not documents of a code corpus
        return _sample(files, DEFAULT_PYTHON_BYTES if config.max_bytes is None else config.max_bytes)
    path = _user_path(config)
    if config.source == "jsonl":
        st = path.stat()
        return [InputFile(str(path), st.st_size, st.st_mtime_ns)]
    files = list(_walk(path, tuple(config.extensions)))
    if not files:
        raise ValueError(
            f"empty corpus: no file under {path} ends with one of {list(config.extensions)}; "
            f"add text files or set CorpusConfig.extensions"
        )
    return _sample(files, config.max_bytes)


def _user_path(config: CorpusConfig) -> Path:
    if config.path is None:
        raise ValueError(f"CorpusConfig(source={config.source!r}) needs path= (the folder or file to read)")
    path = Path(config.path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist (CorpusConfig.path={config.path!r}); fix the path")
    want_dir = config.source in ("folder", "tokens")
    if want_dir != path.is_dir():
        kind = "a folder" if want_dir else "a file"
        raise ValueError(f"CorpusConfig(source={config.source!r}) needs {kind}, but {path} is not one")
    return path


# ---------------------------------------------------------------------------------------------- building


def _settings(config: CorpusConfig) -> dict[str, Any]:
    """The builder settings that change the tokens (not the cache location or printing)."""
    keep = ("source", "path", "extensions", "text_field", "max_bytes", "ascii", "eod", "require_utf8")
    out = {k: v for k, v in asdict(config).items() if k in keep}
    out["extensions"] = list(config.extensions)
    out["path"] = None if config.path is None else str(Path(config.path).expanduser().resolve())
    out["format"] = FORMAT
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprint(config: CorpusConfig, files: Sequence[InputFile]) -> str:
    """Hash of the builder settings and the sorted ``(path, size, mtime)`` of every input file."""
    return _digest({"settings": _settings(config), "files": [[f.path, f.size, f.mtime_ns] for f in files]})


def cache_path(config: CorpusConfig) -> Path:
    """``<cache_dir>/<source>-<settings hash>``: one folder per settings, rebuilt in place when inputs change."""
    if config.cache_dir is not None:
        root = Path(config.cache_dir).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_paradyse"
    return root / f"{config.source}-{_digest(_settings(config))[:12]}"


def _documents(config: CorpusConfig, files: Sequence[InputFile], info: BuildInfo) -> Iterator[tuple[str, bytes]]:
    """``(name, raw bytes)`` of every document; skipped inputs are recorded in ``info.skipped``."""
    if config.source == "jsonl":
        yield from _jsonl_documents(Path(files[0].path), config, info)
        return
    for f in files:
        try:
            data = Path(f.path).read_bytes()
        except OSError:
            info.skipped.setdefault("unreadable", []).append(f.path)
            continue
        info.files_read += 1
        if config.require_utf8 and not _is_utf8(data):
            info.skipped.setdefault("not_utf8", []).append(f.path)
            continue
        yield f.path, data


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _jsonl_documents(path: Path, config: CorpusConfig, info: BuildInfo) -> Iterator[tuple[str, bytes]]:
    total = 0
    with open(path, "rb") as fh:
        info.files_read += 1
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:  # UnicodeDecodeError is a ValueError too, handled below
                raise ValueError(f"{where}: not valid JSON ({err}); fix or remove the line") from err
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 ({err}); re-encode the file as UTF-8") from err
            text = obj.get(config.text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(
                    f"{where}: no string field {config.text_field!r} (found {keys}); set CorpusConfig.text_field"
                )
            data = text.encode("utf-8")
            total += len(data)
            if config.max_bytes is not None and total > config.max_bytes:
                return
            yield where, data


def _progress(config: CorpusConfig, total: int) -> Any:
    from tqdm.auto import tqdm

    show = config.progress and sys.stderr.isatty()
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {config.source} corpus", disable=not show)


def build_corpus(config: CorpusConfig, files: Sequence[InputFile], target: Path, info: BuildInfo) -> dict[str, Any]:
    """Tokenize every document of ``files`` into ``target`` (the on-disk format); returns the manifest."""
    tokenizer = config.tokenizer
    writer = _TokenWriter(target, token_dtype(tokenizer.vocab_size))
    try:
        with _progress(config, sum(f.size for f in files)) as bar:
            for name, data in _documents(config, files, info):
                bar.update(len(data))
                if not data:
                    info.skipped.setdefault("empty", []).append(name)
                    continue
                writer.add(tokenizer.encode(data))
        if len(writer.offsets) == 1:
            raise ValueError(_empty_message(config, files, info))
    except BaseException:
        writer.abort()
        raise
    extra = {
        "fingerprint": fingerprint(config, files),
        "settings": _settings(config),
        "tokenizer": asdict(tokenizer),
        "skipped": {k: len(v) for k, v in info.skipped.items()},
    }
    return writer.finish(tokenizer.vocab_size, extra)


def _empty_message(config: CorpusConfig, files: Sequence[InputFile], info: BuildInfo) -> str:
    where = config.path if config.source != "python" else "the Python installation"
    counts = ", ".join(f"{len(v)} {k}" for k, v in info.skipped.items()) or "nothing skipped"
    return (
        f"empty corpus: {where} ({config.source}, {len(files)} input file(s)) gave no non-empty document ({counts}); "
        f"add documents, check permissions and encodings (require_utf8={config.require_utf8}), or fix the path"
    )


def _warn_skipped(config: CorpusConfig, info: BuildInfo) -> None:
    """One warning per kind of skipped input (user sources only: the Python corpus reports counts)."""
    if config.source == "python":
        return
    reasons = {"unreadable": "could not be read", "not_utf8": "are not UTF-8 text", "empty": "are empty"}
    for kind, names in info.skipped.items():
        first = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        warnings.warn(
            f"corpus {config.path}: skipped {len(names)} input(s) that {reasons[kind]}: {first}", stacklevel=3
        )


def _cached(target: Path, expected: str) -> bool:
    """Whether ``target`` holds a complete corpus built from the inputs with fingerprint ``expected``."""
    try:
        manifest = read_manifest(target)
        _open_arrays(target, manifest)
    except (OSError, ValueError):
        return False
    return manifest.get("fingerprint") == expected


def load_corpus(config: CorpusConfig | None = None) -> TokenCorpus:
    """The corpus of ``config`` (default: the Python sources): from the cache when valid, else built and cached.

    ``source='tokens'`` opens the pre-tokenized folder in place. The returned corpus's ``info`` says whether
    the cache was hit, how many files were read and what was skipped.
    """
    config = config or CorpusConfig()
    start = time.perf_counter()
    if config.source == "tokens":
        return open_token_corpus(_user_path(config))
    files = list_inputs(config)
    target = cache_path(config)
    if _cached(target, fingerprint(config, files)):
        return TokenCorpus(target, BuildInfo(cache_hit=True, seconds=time.perf_counter() - start))
    info = BuildInfo(cache_hit=False)
    build_corpus(config, files, target, info)
    _warn_skipped(config, info)
    info.seconds = time.perf_counter() - start
    corpus = TokenCorpus(target, info)
    if config.verbose:
        print(build_summary(corpus, config))
    return corpus


def open_token_corpus(path: str | os.PathLike[str]) -> TokenCorpus:
    """A pre-tokenized folder; empty documents (equal consecutive offsets) are dropped with a warning."""
    corpus = TokenCorpus(path, BuildInfo(cache_hit=True))
    empty = int(np.sum(corpus.lengths == 0))
    if empty:
        warnings.warn(f"token corpus {corpus.path}: skipped {empty} empty document(s)", stacklevel=2)
        corpus.offsets = np.unique(corpus.offsets)  # an empty document adds a repeated offset and no token
        assert corpus.info is not None
        corpus.info.skipped["empty"] = [str(corpus.path)] * empty
    if "max_token_id" not in corpus.manifest:
        corpus.manifest["max_token_id"] = int(np.max(corpus.tokens))
    return corpus


def build_summary(corpus: TokenCorpus, config: CorpusConfig | None = None) -> str:
    """Build time, size, skipped inputs and the length table (paper buckets and buckets scaled to the max)."""
    info = corpus.info or BuildInfo(cache_hit=True)
    skipped = ", ".join(f"{len(v)} {k}" for k, v in info.skipped.items()) or "none"
    head = (
        f"corpus {corpus.path}: {len(corpus)} documents, {corpus.n_tokens:,} tokens, vocabulary {corpus.vocab_size}, "
        f"{'cache hit' if info.cache_hit else 'built'} in {info.seconds:.1f} s ({info.files_read} files read, "
        f"skipped: {skipped})"
    )
    return head + "\n" + markdown_table(corpus_tables(corpus))


def corpus_tables(
    corpus: TokenCorpus, name: str = "this corpus (bytes)", scale_to: int | None = None
) -> list[LengthTable]:
    """Rows for a README: the paper's GitHubCode and ``corpus`` with the paper's edges, then both with the edges
    scaled so the paper's 309K maps to ``scale_to`` (default: the corpus's longest document)."""
    lengths = corpus.lengths
    scale = int(lengths.max()) if scale_to is None else scale_to
    github = paper_table("github")
    scaled = replace(
        github,  # the paper's shares stay: scaling every edge and the lengths together moves no sequence
        name=f"{github.name}, scaled",
        labels=tuple(bucket_labels(scaled_edges("github", scale))),
        max_len=scale,
    )
    return [
        github,
        length_table(lengths, name),
        scaled,
        length_table(lengths, f"{name}, edges scaled by {scale / github.max_len:.3g}", scale_to=scale),
    ]


def split_documents(n_docs: int, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` document indices (sorted): a seeded random ``val_fraction`` of the documents for validation.

    At least one document stays in each part when ``0 < val_fraction < 1`` and ``n_docs >= 2``.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"split_documents: val_fraction must lie in [0, 1), got {val_fraction}")
    n_val = 0 if val_fraction == 0 else min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    perm = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


__all__ = [
    "DEFAULT_PYTHON_BYTES",
    "FORMAT",
    "BuildInfo",
    "ByteTokenizer",
    "CorpusConfig",
    "InputFile",
    "TokenCorpus",
    "build_summary",
    "cache_path",
    "check_vocab",
    "corpus_tables",
    "fingerprint",
    "list_inputs",
    "load_corpus",
    "open_token_corpus",
    "split_documents",
    "write_token_corpus",
]
