"""Named domains: three-way split by file, built-in sources, balanced batches."""

import gzip

import numpy as np
import pytest
import torch

from decentral.data import DataError, load_documents, train_batches
from decentral.data.domains import BUILTIN_DOMAINS, balanced_eval_batches, load_domain, load_domains, parse_domain


def write_docs(folder, count, word):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{word}{i}.txt").write_text(f"<{word}-{i:03d}> " + f"{word} text number {i}. " * 40)
    return [f"<{word}-{i:03d}>".encode() for i in range(count)]


def test_domain_splits_are_disjoint_and_cover_every_file(tmp_path):
    markers = write_docs(tmp_path / "d", 200, "alpha")
    domain = load_domain(f"alpha={tmp_path / 'd'}", dev_fraction=0.1, test_fraction=0.1)
    splits = [domain.train.tobytes(), domain.dev.tobytes(), domain.test.tobytes()]
    where = [[m in s for s in splits] for m in markers]
    assert all(sum(w) == 1 for w in where)
    dev, test = sum(w[1] for w in where), sum(w[2] for w in where)
    assert 8 <= dev <= 35 and 8 <= test <= 35, (dev, test)
    assert domain.name == "alpha" and domain.num_files == 200


def test_gz_files_are_read_and_bad_specs_are_clear_errors(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"GZIPPED-MARKER " * 400))
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b not really gzip")
    documents, _ = load_documents([tmp_path])
    assert [d.text[:14] for d in documents] == [b"GZIPPED-MARKER"]
    with pytest.raises(DataError, match="broken.gz"):
        load_documents([tmp_path / "broken.gz"])
    with pytest.raises(DataError, match="built-in ones are"):
        parse_domain("klingon")
    with pytest.raises(DataError, match="no path"):
        parse_domain("mine=")
    assert parse_domain("mine=a,b") == ("mine", ["a", "b"])
    with pytest.raises(DataError, match="too small"):
        load_domain(f"tiny={tmp_path / 'a.txt.gz'}")
    write_docs(tmp_path / "x", 100, "x")
    with pytest.raises(DataError, match="distinct"):
        load_domains([f"x={tmp_path / 'x'}", f"x={tmp_path / 'x'}"])


@pytest.mark.parametrize("name", ["code", "legal"])
def test_builtin_domains_exist_here_and_are_what_they_say(name):
    domain = load_domain(name, max_bytes=2_000_000)
    assert min(len(domain.train), len(domain.dev), len(domain.test)) > 4096
    text = domain.train.tobytes()
    assert (b"def " in text) if name == "code" else (b"License" in text or b"license" in text)
    assert name in BUILTIN_DOMAINS


def test_balanced_batches_take_every_domain_equally():
    streams = [np.full(5000, value, dtype=np.uint8) for value in (1, 2, 3)]
    batches = train_batches(streams, batch_size=8, context=16, seed=0)
    counts = np.zeros(4, dtype=int)
    for _ in range(30):
        x, y = next(batches)
        assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
        values = x[:, 0].numpy()
        counts += np.bincount(values, minlength=4)
        assert np.bincount(values, minlength=4)[1:].min() >= 2  # 8 rows over 3 domains: 2 or 3 each
    assert counts[1:].tolist() == [80, 80, 80]  # the remainder rows rotate over the domains


def test_balanced_eval_batches_weigh_domains_equally(tmp_path):
    for letter in "qz":  # every 16-byte window of a document holds its domain's letter
        (tmp_path / letter).mkdir()
        for i in range(120):
            (tmp_path / letter / f"{i}.txt").write_text(f"{letter * 40} {i}\n" * 40)
    domains = load_domains([f"q={tmp_path / 'q'}", f"z={tmp_path / 'z'}"], dev_fraction=0.2, test_fraction=0.2)
    batches = balanced_eval_batches(domains, "dev", batch_size=2, context=16, num_batches=4)
    assert len(batches) == 4
    text = [bytes(x[0].tolist()) for x, _ in batches]
    assert [b"q" in t for t in text] == [True, True, False, False]
    assert [b"z" in t for t in text] == [False, False, True, True]


def test_skipping_batches_goes_on_where_the_sequence_was():
    streams = [np.arange(3000, dtype=np.int64).astype(np.uint8), np.full(3000, 7, dtype=np.uint8)]
    full = train_batches(streams, batch_size=5, context=8, seed=3)
    expected = [next(full) for _ in range(12)][7:]
    later = train_batches(streams, batch_size=5, context=8, seed=3, skip=7)
    for (x, y), (ex, ey) in zip([next(later) for _ in range(5)], expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
