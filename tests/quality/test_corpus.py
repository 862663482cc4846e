"""The stdlib corpus: deterministic listing, disjoint path-hash splits, byte tokenizer, packing."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from flashloop_compile.quality.corpus import (
    BOS,
    EOS,
    VOCAB_SIZE,
    ByteTokenizer,
    Corpus,
    list_documents,
    pack_sequences,
    split_of,
    stdlib_root,
    token_stream,
    unigram_bits_per_byte,
)


@pytest.fixture
def tree(tmp_path):
    files = {
        "a.py": b"import os\n",
        "pkg/__init__.py": b"",
        "pkg/mod.py": "x = '\u00e9'\n".encode(),
        "pkg/site-packages/skip.py": b"no",
        "pkg/__pycache__/skip.py": b"no",
        "notes.txt": b"not python",
    }
    for rel, data in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return tmp_path


def test_listing_is_sorted_deterministic_and_filtered(tree):
    docs = list_documents(tree)
    assert docs == ["a.py", "pkg/__init__.py", "pkg/mod.py"]
    assert list_documents(tree) == docs


def test_stdlib_listing_and_split_are_deterministic_and_disjoint():
    docs = list_documents()
    assert docs == sorted(docs) and len(docs) > 100
    assert not any("site-packages" in d for d in docs)
    a, b = Corpus(), Corpus()
    assert a.train_paths == b.train_paths and a.heldout_paths == b.heldout_paths and a.valid_paths == b.valid_paths
    train, valid, held = set(a.train_paths), set(a.valid_paths), set(a.heldout_paths)
    assert not (train & held) and not (train & valid) and not (valid & held)
    assert train | valid | held == set(docs)
    # about 5% held out, 3% valid (by path hash, so only roughly)
    assert 0.02 < len(held) / len(docs) < 0.09 and 0.01 < len(valid) / len(docs) < 0.06
    assert a.root == stdlib_root()


def test_split_depends_on_the_path_only():
    for path in ["ast.py", "json/decoder.py", "does/not/exist.py"]:
        bucket = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 100
        want = "heldout" if bucket < 5 else "valid" if bucket < 8 else "train"
        assert split_of(path) == want
    # A wider held-out share only moves files out of train/valid, never back.
    c5, c10 = Corpus(heldout_percent=5, valid_percent=0), Corpus(heldout_percent=10, valid_percent=0)
    assert set(c5.heldout_paths) <= set(c10.heldout_paths)


def test_long_documents_and_sequences():
    c = Corpus()
    docs = c.long_documents("heldout", 2000, 3)
    assert len(docs) == 3 and all(len(d) >= 2000 for _, d in docs)
    assert c.long_documents("heldout", 2000, 3) == docs
    seqs = c.sequences("heldout", 2, 300)
    assert [s.shape for s in seqs] == [torch.Size([300])] * 2
    assert int(seqs[0][0]) == BOS and int(seqs[0][1:].max()) < 256
    with pytest.raises(ValueError, match="only"):
        c.sequences("heldout", 10_000, 300)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 264 and tok.has_specials
    text = "def f(x):\n    return 'h\u00e9llo \u2603'\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and all(0 <= i < 256 for i in ids[1:-1])
    assert tok.decode(ids) == text.encode()
    assert tok.decode(torch.tensor(ids)).decode() == text
    assert tok.encode(b"\x00\xff") == [0, 255]
    bare = ByteTokenizer(256)
    assert not bare.has_specials and bare.bos_id is None
    assert bare.encode("ab", bos=True, eos=True) == [97, 98]
    with pytest.raises(ValueError):
        ByteTokenizer(200)


def test_stream_and_packing():
    s = token_stream([b"ab", b"", b"c"])
    assert s.tolist() == [BOS, 97, 98, EOS, BOS, EOS, BOS, 99, EOS]
    rows = pack_sequences(s, 4)
    assert rows.shape == (2, 5)
    assert rows[0].tolist() == s[:5].tolist() and rows[1].tolist() == s[4:9].tolist()
    with pytest.raises(ValueError):
        pack_sequences(s[:3], 4)


def test_unigram_baseline():
    uniform = bytes(range(256)) * 4
    assert unigram_bits_per_byte([uniform], [uniform]) == pytest.approx(8.0, abs=1e-9)
    skewed = b"a" * 1000 + b"b" * 1000
    bits = unigram_bits_per_byte([skewed], [skewed])
    assert 1.0 < bits < 1.2  # ~1 bit, plus add-one smoothing over 256 symbols
    assert math.isfinite(unigram_bits_per_byte([b"a"], [b"z"]))


def test_package_sources_join_the_corpus_under_their_package_name(tree, monkeypatch):
    from flashloop_compile.quality.corpus import PACKAGE_PREFIX, package_root

    site = tree / "site"
    for rel in ("fakepkg/__init__.py", "fakepkg/core/ops.py", "fakepkg/__pycache__/x.py"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(f"# {rel}\n".encode())
    monkeypatch.syspath_prepend(str(site))
    assert package_root("fakepkg") == site / "fakepkg"
    corpus = Corpus(root=tree, packages=("fakepkg",))
    names = ["fakepkg/__init__.py", "fakepkg/core/ops.py"]
    every = sorted(corpus.train_paths + corpus.valid_paths + corpus.heldout_paths)
    assert every == sorted(list_documents(tree) + [PACKAGE_PREFIX + n for n in names])
    for n in names:
        path = PACKAGE_PREFIX + n
        assert split_of(path) in ("train", "valid", "heldout") and path in corpus.paths(split_of(path))
        assert corpus.read(path) == f"# {n}\n".encode()
    # the stdlib's documents and their splits do not move when packages join
    plain = Corpus(root=tree)
    assert set(plain.heldout_paths) <= set(corpus.heldout_paths) and set(plain.train_paths) <= set(corpus.train_paths)
    with pytest.raises(FileNotFoundError, match="'no_such_pkg_xyz' is not an installed package"):
        Corpus(root=tree, packages=("no_such_pkg_xyz",))
    with pytest.raises(FileNotFoundError, match="top-level package"):
        package_root("fakepkg.core")


def test_retrieval_documents_state_each_needle_before_asking_it_again_with_its_answer():
    import random
    import re

    from flashloop_compile.quality.corpus import needle_line, query_prefix, retrieval_document

    filler = b"".join(f"line_{i} = {i * 7}\n".encode() for i in range(200))
    for seed in range(20):
        doc = retrieval_document(filler, random.Random(seed), pairs=5)
        found = re.findall(rb'(needle_[a-z0-9]{4}) = "([a-z0-9]{6})"', doc)
        assert len(found) == 10  # five statements, five questions with their answers
        stated, asked = dict(found[:5]), found[5:]
        assert len(stated) == 5 and sorted(asked) == sorted(stated.items())
        questions = b"".join(query_prefix(k.decode()) + v + b'"' for k, v in asked) + b"\n"
        assert doc.endswith(questions)  # every question after every statement
        text = doc[: -len(questions)]
        for key, value in asked:
            at = text.index(needle_line(key.decode(), value.decode()))
            assert at == 0 or text[at - 1:at] == b"\n"  # a statement on a line of its own
        # the filler is all there, in order, once the statements are taken out
        assert re.sub(rb'needle_[a-z0-9]{4} = "[a-z0-9]{6}"\n', b"", text) == filler
    assert retrieval_document(filler, random.Random(3)) == retrieval_document(filler, random.Random(3))
    with pytest.raises(ValueError, match="at least one needle"):
        retrieval_document(filler, random.Random(0), pairs=0)
