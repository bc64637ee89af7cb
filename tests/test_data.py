import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decentral.data import (
    ByteTokenizer,
    default_corpus_paths,
    eval_batches,
    evaluate,
    load_corpus,
    shard_bounds,
    train_batches,
)
from decentral.models import GPT, GPTConfig


def write_files(folder: Path, count: int, size: int = 600) -> list[str]:
    """`count` distinct text files, each holding a unique marker; returns the markers."""
    folder.mkdir(parents=True, exist_ok=True)
    markers = []
    for i in range(count):
        marker = f"<<file-{i:04d}>>"
        (folder / f"f{i}.txt").write_text(marker + "\n" + f"line {i} of some text\n" * (size // 20))
        markers.append(marker)
    return markers


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo wörld ✓ 日本 🐍'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert tok.vocab_size == 256


def test_default_corpus_paths_are_stdlib_sources():
    paths = default_corpus_paths()
    assert len(paths) > 100 and paths == sorted(paths)
    assert all(p.suffix == ".py" for p in paths)
    assert not any({"site-packages", "test", "tests"} & set(p.parts[-4:-1]) for p in paths)
    assert any(p.name == "os.py" for p in paths)


def test_default_corpus_is_real_deterministic_and_split_by_file():
    a, b = load_corpus(max_bytes=1_000_000), load_corpus(max_bytes=1_000_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train.dtype == np.uint8 and len(a.train) > 0 and len(a.val) > 0
    assert 1_000_000 <= len(a.train) + len(a.val) < 2_000_000
    assert b"def " in a.train.tobytes() and b"import " in a.val.tobytes()
    train, val = a.train.tobytes(), a.val.tobytes()
    found = 0
    for path in default_corpus_paths():
        content = path.read_bytes()
        if len(content) < 200:
            continue  # short files may occur inside longer ones
        in_train, in_val = content in train, content in val
        assert not (in_train and in_val), path
        found += in_train or in_val
    assert found > 0.9 * a.num_files


def test_files_land_in_exactly_one_split(tmp_path):
    markers = write_files(tmp_path, 60)
    corpus = load_corpus([tmp_path], val_fraction=0.3)
    train, val = corpus.train.tobytes(), corpus.val.tobytes()
    assert corpus.num_files == 60
    assert all((m.encode() in train) != (m.encode() in val) for m in markers)
    assert 5 < sum(m.encode() in val for m in markers) < 35


def test_split_ignores_file_location_and_seed_changes_it(tmp_path):
    write_files(tmp_path / "a", 60)
    write_files(tmp_path / "b" / "deeper", 60)
    a = load_corpus([tmp_path / "a"], val_fraction=0.3)
    b = load_corpus([tmp_path / "b"], val_fraction=0.3)
    c = load_corpus([tmp_path / "a"], val_fraction=0.3, seed=1)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val)


def test_duplicates_count_once(tmp_path):
    write_files(tmp_path, 40)
    single = load_corpus([tmp_path], val_fraction=0.3)
    (tmp_path / "copy.txt").write_bytes((tmp_path / "f0.txt").read_bytes())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f1.txt").write_bytes((tmp_path / "f1.txt").read_bytes())
    doubled = load_corpus([tmp_path, tmp_path / "f2.txt"], val_fraction=0.3)
    assert doubled.num_files == single.num_files == 40
    assert np.array_equal(doubled.train, single.train) and np.array_equal(doubled.val, single.val)


def test_skips_binary_hidden_and_reads_jsonl(tmp_path):
    write_files(tmp_path, 40)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("HIDDEN-MARKER " * 100)
    (tmp_path / "sitecustomize.py").symlink_to(tmp_path / "removed")  # as Debian's stdlib has, to /etc
    rows = [{"text": f"JSONL-RECORD-{i} " * 30, "id": i} for i in range(3)]
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    corpus = load_corpus([tmp_path], val_fraction=0.3)
    everything = corpus.train.tobytes() + corpus.val.tobytes()
    assert corpus.num_files == 41
    assert b"binary" not in everything and b"caf" not in everything and b"HIDDEN" not in everything
    assert all(f"JSONL-RECORD-{i}".encode() in everything for i in range(3))
    assert b'"id"' not in everything


def test_bad_inputs_raise_clearly(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(ValueError, match="no-such-folder"):
        load_corpus([missing])
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too small"):
        load_corpus([tmp_path])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_corpus([tmp_path])
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="blob.bin"):
        load_corpus([tmp_path / "blob.bin"])


def test_shards_tile_the_stream():
    for n, k in [(100, 3), (7, 7), (1000, 4)]:
        bounds = [shard_bounds(n, w, k) for w in range(k)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[w][1] == bounds[w + 1][0] for w in range(k - 1))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    with pytest.raises(ValueError):
        shard_bounds(100, 3, 3)
    with pytest.raises(ValueError):
        shard_bounds(100, -1, 3)


def test_train_batches_are_shifted_deterministic_and_per_worker():
    half = np.random.default_rng(0).integers(0, 256, 2000).astype(np.uint8)
    tokens = np.concatenate([half, half])  # both shards hold the same text: only the seeding can tell them apart

    def take(worker: int, seed: int = 0, n: int = 5):
        it = train_batches(tokens, batch_size=4, context=8, worker=worker, num_workers=2, seed=seed)
        return torch.stack([torch.stack(next(it)) for _ in range(n)])

    first = take(0)
    x, y = first[0]
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(first, take(0))
    assert not torch.equal(first, take(1))
    assert not torch.equal(first, take(0, seed=1))


def test_train_batches_stay_in_own_shard():
    tokens = np.repeat(np.arange(4, dtype=np.uint8), 500)  # shard w of 4 holds only the value w
    for worker in range(4):
        it = train_batches(tokens, batch_size=8, context=16, worker=worker, num_workers=4, seed=3)
        for _ in range(20):
            x, y = next(it)
            assert (x == worker).all() and (y == worker).all()


def test_train_batches_short_shard_raises():
    with pytest.raises(ValueError, match="context"):
        train_batches(np.zeros(40, dtype=np.uint8), batch_size=2, context=16, worker=0, num_workers=4)


def test_eval_batches_are_fixed_and_spread():
    tokens = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint8)  # windows are unique
    a = eval_batches(tokens, batch_size=4, context=32, num_batches=5)
    b = eval_batches(tokens, batch_size=4, context=32, num_batches=5)
    assert len(a) == 5
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in a)
    assert a[0][0].shape == (4, 32)
    stream = tokens.tobytes()
    starts = [stream.find(bytes(row.tolist())) for x, _ in a for row in x]
    gaps = np.diff(starts)
    assert starts[0] < 600 and starts[-1] > 9000 and gaps.min() > 0


def test_evaluate_restores_mode_and_needs_no_grad():
    torch.manual_seed(0)
    model = GPT(GPTConfig(context=16, n_layer=1, n_head=2, d_model=16, dropout=0.5))
    batches = eval_batches((np.arange(3000) % 256).astype(np.uint8), batch_size=2, context=16, num_batches=3)
    model.train()
    loss = evaluate(model, batches)
    assert model.training and abs(loss - np.log(256)) < 0.3
    assert evaluate(model, batches) == loss  # dropout is off during evaluation
    model.eval()
    assert evaluate(model, batches) == loss and not model.training
    assert all(p.grad is None for p in model.parameters())
