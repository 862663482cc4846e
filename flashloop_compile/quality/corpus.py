"""An offline text corpus every machine has: the running interpreter's standard library source.

Documents are the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
and ``dist-packages`` excluded), identified by their POSIX path relative to that root and listed
in sorted order. The train / held-out split is by file, on the bucket ``int(sha256(relative_path).hexdigest()[:8], 16) % 100``:

    held-out    bucket < heldout_percent                                   (default 5: evaluation)
    valid       heldout_percent <= bucket < heldout_percent + valid_percent (default 3: training's
                                                                            checkpoint selection)
    train       the rest

so the split depends on the path alone, never on file contents, order or the Python version
(a path present in two versions lands on the same side in both; contents may differ). Held-out
files are never trained on, on any machine: the GPU image's stdlib (Ubuntu, no ``test/``) is
about a third of a full one, but its held-out files are held out everywhere.

``Corpus(packages=("torch", "triton", ...))`` adds the ``*.py`` files of installed packages
(found by ``importlib``, never imported), named ``packages/<package>/<path in the package>`` and
split by the same rule on that name.

Synthetic retrieval documents (:func:`retrieval_document`) teach the needle task the evaluation
asks (evaluate.py): lines ``{key} = "{value}"`` at random line boundaries of a filler text, then
every key asked again, answer included. Keys and values come from :func:`needle_line`'s alphabet,
the format the evaluation's prompts use.

Tokenizer: bytes. Ids 0..255 are the bytes, then BOS = 256, EOS = 257, PAD = 258; checkpoints
trained here use ``VOCAB_SIZE = 264`` (259 rounded up to a multiple of 8). A model with a
vocabulary of 256 (the ``tiny`` preset) gets a tokenizer without special tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "stdlib_root",
    "list_documents",
    "is_heldout",
    "split_of",
    "Corpus",
    "token_stream",
    "pack_sequences",
    "unigram_bits_per_byte",
    "PACKAGE_PREFIX",
    "package_root",
    "KEY_CHARS",
    "random_needle",
    "needle_line",
    "query_prefix",
    "retrieval_document",
]

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 264

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer; special tokens exist only when the vocabulary has room for them."""

    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {self.vocab_size}")

    @property
    def has_specials(self) -> bool:
        return self.vocab_size > PAD

    @property
    def bos_id(self) -> int | None:
        return BOS if self.has_specials else None

    @property
    def eos_id(self) -> int | None:
        return EOS if self.has_specials else None

    def encode(self, data: bytes | str, *, bos: bool = False, eos: bool = False) -> list[int]:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        ids = list(raw)
        if bos and self.has_specials:
            ids.insert(0, BOS)
        if eos and self.has_specials:
            ids.append(EOS)
        return ids

    def decode(self, ids: Iterable[int] | Tensor) -> bytes:
        """Bytes of the ids; special tokens are dropped."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256)


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_documents(root: str | Path | None = None) -> list[str]:
    """Sorted POSIX paths (relative to ``root``) of the ``*.py`` files under it."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        out.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    if not out:
        raise FileNotFoundError(f"no *.py files under {root}: the corpus needs the interpreter's standard library source")
    return sorted(out)


PACKAGE_PREFIX = "packages/"


def package_root(name: str) -> Path:
    """The source directory of the installed package ``name`` (located, not imported)."""
    spec = importlib.util.find_spec(name) if name and "." not in name and "/" not in name else None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"corpus package {name!r} is not an installed package here: name a top-level package "
                                "that `python3 -c 'import NAME'` finds (e.g. torch, triton, sympy)")
    return Path(locations[0])


def _path_hash(relpath: str) -> int:
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16)


def is_heldout(relpath: str, heldout_percent: int = 5) -> bool:
    """Whether a document (by its relative path) belongs to the held-out split."""
    return _path_hash(relpath) % 100 < heldout_percent


def split_of(relpath: str, heldout_percent: int = 5, valid_percent: int = 3) -> str:
    """``heldout``, ``valid`` or ``train`` (see the module doc)."""
    bucket = _path_hash(relpath) % 100
    if bucket < heldout_percent:
        return "heldout"
    return "valid" if bucket < heldout_percent + valid_percent else "train"


@dataclass
class Corpus:
    """The stdlib source split by file into train and held-out documents."""

    root: Path = field(default_factory=stdlib_root)
    heldout_percent: int = 5
    valid_percent: int = 3
    max_doc_bytes: int | None = None
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not (0 < self.heldout_percent and 0 <= self.valid_percent and self.heldout_percent + self.valid_percent < 100):
            raise ValueError(f"need 0 < heldout_percent, 0 <= valid_percent, sum < 100; got {self.heldout_percent}, {self.valid_percent}")
        self.packages = tuple(self.packages)
        self.package_roots = {name: package_root(name) for name in self.packages}
        docs = list_documents(self.root)
        for name, root in self.package_roots.items():
            docs += [f"{PACKAGE_PREFIX}{name}/{p}" for p in list_documents(root)]
        splits = {p: split_of(p, self.heldout_percent, self.valid_percent) for p in docs}
        self.train_paths = [p for p in docs if splits[p] == "train"]
        self.valid_paths = [p for p in docs if splits[p] == "valid"]
        self.heldout_paths = [p for p in docs if splits[p] == "heldout"]

    def paths(self, split: str) -> list[str]:
        if split == "train":
            return self.train_paths
        if split == "valid":
            return self.valid_paths
        if split in ("heldout", "held-out", "test"):
            return self.heldout_paths
        raise ValueError(f"split must be 'train', 'valid' or 'heldout', got {split!r}")

    def read(self, relpath: str) -> bytes:
        if relpath.startswith(PACKAGE_PREFIX):
            name, _, rest = relpath[len(PACKAGE_PREFIX):].partition("/")
            data = (self.package_roots[name] / rest).read_bytes()
        else:
            data = (self.root / relpath).read_bytes()
        return data if self.max_doc_bytes is None else data[: self.max_doc_bytes]

    def documents(self, split: str) -> list[bytes]:
        """Every document of a split, in sorted path order."""
        return [self.read(p) for p in self.paths(split)]

    def long_documents(self, split: str, min_bytes: int, n: int | None = None) -> list[tuple[str, bytes]]:
        """Up to ``n`` documents of at least ``min_bytes`` bytes, ordered by path hash (which
        mixes directories) then path: a deterministic, diverse sample."""
        out = []
        for p in sorted(self.paths(split), key=lambda p: (_path_hash("order:" + p), p)):
            data = self.read(p)
            if len(data) >= min_bytes:
                out.append((p, data))
                if n is not None and len(out) >= n:
                    break
        return out

    def sequences(self, split: str, n: int, length: int, tokenizer: ByteTokenizer | None = None) -> list[Tensor]:
        """``n`` token sequences of exactly ``length`` tokens: the start of each of ``n`` long
        documents (BOS first when the tokenizer has one), distinct documents."""
        tok = tokenizer or ByteTokenizer()
        docs = self.long_documents(split, length, n)
        if len(docs) < n:
            raise ValueError(f"only {len(docs)} {split} documents have >= {length} bytes; asked for {n}")
        return [torch.tensor(tok.encode(d, bos=True)[:length], dtype=torch.long) for _, d in docs]


def token_stream(docs: Sequence[bytes], tokenizer: ByteTokenizer | None = None) -> Tensor:
    """All documents as one int16 stream: [BOS] doc [EOS] [BOS] doc [EOS] ..."""
    tok = tokenizer or ByteTokenizer()
    parts = []
    for d in docs:
        if tok.has_specials:
            parts.append(torch.tensor([BOS], dtype=torch.int16))
        if d:
            parts.append(torch.frombuffer(bytearray(d), dtype=torch.uint8).to(torch.int16))
        if tok.has_specials:
            parts.append(torch.tensor([EOS], dtype=torch.int16))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)


def pack_sequences(stream: Tensor, seq_len: int) -> Tensor:
    """Non-overlapping [N, seq_len + 1] rows (inputs are row[:-1], targets row[1:]); the
    remainder that does not fill a row is dropped."""
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"a stream of {stream.numel()} tokens is too short for one sequence of {seq_len}")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None]
    return stream.long()[idx]


def unigram_bits_per_byte(train_docs: Sequence[bytes], eval_docs: Sequence[bytes]) -> float:
    """Cross-entropy (bits per byte) of ``eval_docs`` under the byte unigram distribution of
    ``train_docs`` with add-one smoothing: the baseline a trained model must beat."""
    def histogram(docs: Sequence[bytes]) -> Tensor:
        data = b"".join(docs)
        if not data:
            return torch.zeros(256, dtype=torch.float64)
        return torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), minlength=256).double()

    train, held = histogram(train_docs), histogram(eval_docs)
    p = (train + 1.0) / (train.sum() + 256.0)
    return float(-(held * torch.log2(p)).sum() / held.sum().clamp_min(1.0))


# -- synthetic retrieval documents -------------------------------------------------------------------

KEY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def random_needle(rng: random.Random, value_len: int = 6) -> tuple[str, str]:
    """A (key, value) pair: ``needle_`` and 4 characters, and ``value_len`` characters of KEY_CHARS."""
    key = "needle_" + "".join(rng.choice(KEY_CHARS) for _ in range(4))
    return key, "".join(rng.choice(KEY_CHARS) for _ in range(value_len))


def needle_line(key: str, value: str) -> bytes:
    """The line that states a key's value."""
    return f'{key} = "{value}"\n'.encode()


def query_prefix(key: str) -> bytes:
    """What asks for a key's value: the answer follows it."""
    return f'\n{key} = "'.encode()


def retrieval_document(filler: bytes, rng: random.Random, *, pairs: int = 4, value_len: int = 6) -> bytes:
    """``filler`` with ``pairs`` needle lines at random line boundaries (at random depths of the
    text; at random offsets where it has no line breaks there), then every key asked in a random
    order, each answer and its closing quote given: ``...query_prefix(key) value"``. Distinct keys."""
    if pairs < 1:
        raise ValueError(f"a retrieval document needs at least one needle, got pairs={pairs}")
    needles: dict[str, str] = {}
    while len(needles) < pairs:
        key, value = random_needle(rng, value_len)
        needles.setdefault(key, value)
    cuts = []
    for _ in needles:
        target = rng.randrange(len(filler) + 1)
        nl = filler.rfind(b"\n", 0, target)
        cuts.append(nl + 1 if nl >= 0 else target)
    cuts.sort()
    parts, last = [], 0
    for cut, (key, value) in zip(cuts, needles.items()):
        parts += [filler[last:cut], needle_line(key, value)]
        last = cut
    parts.append(filler[last:])
    order = list(needles)
    rng.shuffle(order)
    for key in order:
        parts += [query_prefix(key), needles[key].encode(), b'"']
    return b"".join(parts) + b"\n"
