"""c-BTM clustering and routing (decentral.experts.clusters) on real documents from this machine:
Python stdlib sources, license texts and man pages."""

from __future__ import annotations

import gzip
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from sklearn.decomposition import TruncatedSVD  # noqa: E402
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer  # noqa: E402
from sklearn.preprocessing import normalize  # noqa: E402

from decentral.experts.clusters import N_FEATURES, Router, fit_router  # noqa: E402

SIZE = 3000  # characters per document: the middle of each file, past headers and boilerplate
CODE, LICENSE, MAN = 0, 1, 2


def middles(paths: list[Path], count: int, read: Callable[[Path], str]) -> list[str]:
    """`count` distinct SIZE-character middles of files at least 2*SIZE long, spread over sorted `paths`."""
    found: dict[str, None] = {}
    for path in paths[:: max(1, len(paths) // (20 * count))]:
        try:
            text = read(path)
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        if len(text) >= 2 * SIZE:
            found.setdefault(text[len(text) // 2 - SIZE // 2 : len(text) // 2 + SIZE // 2])
        if len(found) == count:
            return list(found)
    pytest.skip(f"found only {len(found)} of {count} documents like {paths[0] if paths else '(none)'}")


@pytest.fixture(scope="module")
def sources() -> dict[int, list[str]]:
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    licenses = sorted(Path("/usr/share/common-licenses").glob("*")) + sorted(Path("/usr/share/doc").glob("*/copyright"))
    man_pages = sorted(Path("/usr/share/man/man1").glob("*.gz"))
    return {
        CODE: middles(stdlib, 90, Path.read_text),
        LICENSE: middles(licenses, 70, Path.read_text),
        MAN: middles(man_pages, 60, lambda p: gzip.decompress(p.read_bytes()).decode()),
    }


@pytest.fixture(scope="module")
def corpus(sources) -> tuple[list[str], np.ndarray]:
    """60 documents of each source, and each one's source."""
    texts = sources[CODE][:60] + sources[LICENSE][:60] + sources[MAN][:60]
    return texts, np.repeat([CODE, LICENSE, MAN], 60)


@pytest.fixture(scope="module")
def held_out_licenses(sources) -> list[str]:
    return sources[LICENSE][60:]


@pytest.fixture(scope="module")
def fitted(corpus) -> tuple[Router, np.ndarray]:
    return fit_router(corpus[0], 3, seed=0)


def cluster_of(source: int, labels: np.ndarray, assignment: np.ndarray) -> int:
    """The cluster holding most documents of `source`."""
    return int(np.bincount(assignment[labels == source]).argmax())


def test_three_sources_give_pure_balanced_clusters(corpus, fitted):
    (texts, labels), (router, assignment) = corpus, fitted
    assert assignment.shape == (len(texts),) and np.issubdtype(assignment.dtype, np.integer)
    assert np.bincount(assignment, minlength=3).tolist() == [60, 60, 60]
    for cluster in range(3):
        members = labels[assignment == cluster]
        assert np.bincount(members).max() / len(members) >= 0.9
    assert len({cluster_of(source, labels, assignment) for source in (CODE, LICENSE, MAN)}) == 3
    assert router.k == 3 and router.centres.shape == (3, router.dim)


@pytest.mark.parametrize("n_licenses, sizes", [(30, [40, 40, 40]), (31, [40, 40, 41]), (32, [40, 41, 41])])
def test_balance_holds_for_unequal_groups(sources, n_licenses, sizes):
    texts = sources[CODE][:90] + sources[LICENSE][:n_licenses]
    _, assignment = fit_router(texts, 3, dim=32)
    assert sorted(np.bincount(assignment, minlength=3)) == sizes
    # the licenses still share a cluster: balance moves code documents, not the minority group
    assert np.bincount(assignment[90:]).max() >= 0.8 * n_licenses


@pytest.mark.parametrize("per_source", [60, 41])
def test_sampled_fit_assigns_all_texts_balanced(sources, per_source):
    """n > fit_sample: centres from a sample, then every text assigned, sizes still within one."""
    texts = sources[CODE][:per_source] + sources[LICENSE][:per_source] + sources[MAN][: per_source - 1]
    labels = np.repeat([CODE, LICENSE, MAN], [per_source, per_source, per_source - 1])
    _, assignment = fit_router(texts, 3, fit_sample=100)
    sizes = np.bincount(assignment, minlength=3)
    assert assignment.shape == (len(texts),) and sizes.max() - sizes.min() <= 1
    purity = sum(np.bincount(labels[assignment == c]).max() for c in range(3)) / len(texts)
    assert purity >= 0.85


def test_weights_are_softmax_of_minus_squared_distance(corpus, fitted):
    texts, (router, _) = corpus[0], fitted
    embedded = router.embed(texts)
    sq_dist = ((embedded[:, None, :] - router.centres[None, :, :]) ** 2).sum(axis=2)
    np.testing.assert_allclose(router.sq_distances(texts), sq_dist, atol=1e-12)

    def softmax(logits):
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    weights = router.weights(texts)
    np.testing.assert_allclose(weights, softmax(-sq_dist / 0.1), rtol=1e-9, atol=1e-12)
    assert not np.allclose(weights, softmax(-(sq_dist**2) / 0.1), atol=1e-3)  # the reference's squared-twice bug
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    np.testing.assert_allclose(router.weights(texts, temperature=1.0), softmax(-sq_dist), rtol=1e-9, atol=1e-12)
    assert np.array_equal(router.assign(texts), sq_dist.argmin(axis=1))


def test_top_k_keeps_the_largest_weights_renormalised(corpus, fitted):
    texts, (router, _) = corpus[0], fitted
    full = router.weights(texts)
    top2 = router.weights(texts, top_k=2)
    rows = np.arange(len(texts))
    assert np.all(top2[rows, full.argmin(axis=1)] == 0.0)
    assert np.all(np.count_nonzero(top2, axis=1) == 2)
    kept = np.where(top2 > 0, full, 0.0)
    np.testing.assert_allclose(top2, kept / kept.sum(axis=1, keepdims=True))
    top1 = router.weights(texts, top_k=1)
    assert np.array_equal(top1, np.eye(3)[full.argmax(axis=1)])
    np.testing.assert_allclose(router.weights(texts, top_k=3), full)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="top_k"):
            router.weights(texts, top_k=bad)
    with pytest.raises(ValueError, match="temperature"):
        router.weights(texts, temperature=0.0)


def test_held_out_license_routes_to_the_license_cluster(corpus, fitted, held_out_licenses):
    (_, labels), (router, assignment) = corpus, fitted
    licenses = cluster_of(LICENSE, labels, assignment)
    weights = router.weights(held_out_licenses)
    assert weights[:, licenses].mean() >= 0.8
    assert np.mean(router.assign(held_out_licenses) == licenses) >= 0.8


def test_embed_matches_sklearn_tfidf_and_svd(corpus, fitted, held_out_licenses):
    texts, (router, _) = corpus[0], fitted
    hashing = HashingVectorizer(n_features=N_FEATURES, alternate_sign=False, norm=None)
    tfidf = TfidfTransformer().fit(hashing.transform(texts))
    rows = tfidf.transform(hashing.transform(texts))
    svd = TruncatedSVD(n_components=router.dim, algorithm="arpack", random_state=0).fit(rows)
    np.testing.assert_array_equal(router.idf, tfidf.idf_)
    assert abs(router.tfidf(texts) - rows).max() <= 1e-12
    np.testing.assert_allclose(router.embed(texts), normalize(svd.transform(rows)), atol=1e-9)
    unseen = tfidf.transform(hashing.transform(held_out_licenses))  # terms the fit never saw
    assert abs(router.tfidf(held_out_licenses) - unseen).max() <= 1e-12
    np.testing.assert_allclose(router.embed(held_out_licenses), normalize(svd.transform(unseen)), atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(router.embed(texts), axis=1), 1.0)


def test_save_load_round_trip(tmp_path, corpus, fitted):
    texts, (router, _) = corpus[0], fitted
    path = tmp_path / "router.npz"
    router.save(path)
    loaded = Router.load(path)
    assert router.components.shape[1] < N_FEATURES / 10  # only the columns of seen terms are kept
    np.testing.assert_array_equal(loaded.components, router.components)
    np.testing.assert_array_equal(loaded.feature_index, router.feature_index)
    np.testing.assert_array_equal(loaded.idf, router.idf)
    np.testing.assert_array_equal(loaded.centres, router.centres)
    assert loaded.temperature == router.temperature
    np.testing.assert_array_equal(loaded.weights(texts, top_k=2), router.weights(texts, top_k=2))


@pytest.mark.parametrize(
    "damage",
    ["text", "truncated", "no centres", "centres dim", "index out of range", "pickled meta", "format"],
)
def test_malformed_file_raises_value_error(tmp_path, fitted, damage):
    router, path = fitted[0], tmp_path / "router.npz"
    router.save(path)
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    if damage == "text":
        path.write_text("not a router")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        if damage == "no centres":
            del arrays["centres"]
        elif damage == "centres dim":
            arrays["centres"] = arrays["centres"][:, :-1]
        elif damage == "index out of range":
            arrays["feature_index"] = arrays["feature_index"] + N_FEATURES
        elif damage == "pickled meta":
            arrays["meta"] = np.array([{"format": 1}], dtype=object)
        elif damage == "format":
            arrays["meta"] = np.array('{"format": 99, "temperature": 0.1, "n_features": 262144}')
        np.savez(path, **arrays)
    with pytest.raises(ValueError, match="not a router file"):
        Router.load(path)


def test_same_seed_same_clusters(corpus, fitted):
    texts, (router, assignment) = corpus[0], fitted
    again, assignment_again = fit_router(texts, 3, seed=0)
    assert np.array_equal(assignment_again, assignment)
    np.testing.assert_array_equal(again.centres, router.centres)


def test_invalid_inputs(corpus):
    texts = corpus[0][:6]
    for k in (0, 7):
        with pytest.raises(ValueError, match="k"):
            fit_router(texts, k)
    with pytest.raises(ValueError, match="no texts"):
        fit_router([], 1)
    with pytest.raises(ValueError, match="sequence of strings"):
        fit_router("one document", 1)


def test_routing_needs_no_sklearn_until_it_embeds(tmp_path, monkeypatch, corpus, fitted):
    texts, (router, _) = corpus[0], fitted
    router.save(tmp_path / "router.npz")
    for name in [m for m in sys.modules if m.split(".")[0] in ("sklearn", "scipy")]:
        monkeypatch.setitem(sys.modules, name, None)
    loaded = Router.load(tmp_path / "router.npz")
    with pytest.raises(ImportError, match=r"pip install 'decentral\[cluster\]'"):
        loaded.weights(texts[:2])
    with pytest.raises(ImportError, match=r"pip install 'decentral\[cluster\]'"):
        fit_router(texts, 3)


def test_routed_ensemble_weights_each_window_by_the_text_before_it(tmp_path):
    """c-BTM evaluation: every test window is scored by the experts mixed with the router's weights
    of the bytes just before it, found here by searching the stream for the window."""
    import dataclasses

    import torch

    from decentral.data.domains import load_domain
    from decentral.experts.evaluate import ROUTE_BYTES, EvalConfig, routed_report, score_experts
    from decentral.experts.registry import Expert, model_bytes, write_expert
    from decentral.models import GPT, GPTConfig

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(400)]  # windows are unique
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(120):
        (folder / f"{i}.txt").write_text(" ".join(rng.choice(words[:200] if i % 2 else words[200:], 300)))
    domain = load_domain(f"mixed={folder}", dev_fraction=0.2, test_fraction=0.2)
    router, _ = fit_router([p.read_text() for p in sorted(folder.iterdir())], 2)
    config = GPTConfig(n_layer=1, n_head=2, d_model=16, context=32)
    experts = []
    for j in range(2):
        torch.manual_seed(j)
        state = GPT(config).state_dict()
        meta = Expert(name=f"c{j}", sha256="", size=0, model=dataclasses.asdict(config))
        experts.append(write_expert(tmp_path / "reg" / f"c{j}", lambda p, s=state: p.write_bytes(model_bytes(s)), meta))
    eval_config = EvalConfig(batch_size=4, context=32, test_batches=3)
    scores = score_experts(experts, [domain], eval_config, splits=("test",))
    report = routed_report(router, [domain], scores, eval_config)["mixed"]

    stream = domain.test.tobytes()
    batches = domain.eval_batches("test", batch_size=4, context=32, num_batches=3)
    nll = []
    for b, (x, _) in enumerate(batches):
        for row in range(4):
            start = stream.find(bytes(x[row].tolist()))
            weights = router.weights([stream[max(0, start - ROUTE_BYTES):start].decode("utf-8", "replace")])[0]
            mixture = sum(w * scores["mixed"].test[j, b, row].exp() for j, w in enumerate(weights))
            nll.append(-mixture.log())
    assert report["perplexity"] == pytest.approx(float(torch.stack(nll).mean().exp()), rel=1e-4)


def test_cluster_cli_refuses_a_used_out_and_bad_counts_and_replace_clears_old_clusters(tmp_path, prefork):
    rng = np.random.default_rng(0)
    data = tmp_path / "docs"
    data.mkdir()
    vocabularies = [[f"{kind}{i}" for i in range(50)] for kind in ("alpha", "beta", "gamma")]
    for i in range(24):
        (data / f"{i}.txt").write_text(" ".join(rng.choice(vocabularies[i % 3], 200)))

    def cluster(*args):
        return prefork.run(["experts", "cluster", "--data", "docs", "--out", "out", *args], tmp_path, timeout=120)

    done = cluster("--k", "3")
    assert done.returncode == 0, done.stderr
    router = (tmp_path / "out" / "router.npz").read_bytes()
    done = cluster("--k", "2")
    assert done.returncode == 2 and "--out out is not empty" in done.stderr and "--replace" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "clustering" not in done.stderr, done.stderr
    assert (tmp_path / "out" / "router.npz").read_bytes() == router and (tmp_path / "out" / "c2").is_dir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    done = cluster("--k", "2", "--replace")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c0", "c1", "notes.txt", "router.npz"]
    assert sum(len(list((tmp_path / "out" / c).iterdir())) for c in ("c0", "c1")) == 24  # no document of the old run
    assert Router.load(tmp_path / "out" / "router.npz").k == 2
    for bad in (["--k", "0"], ["--k", "-2"], ["--k", "2", "--max-bytes", "0"]):
        done = prefork.run(["experts", "cluster", "--data", "docs", "--out", "new", *bad], tmp_path, timeout=60)
        assert done.returncode == 2 and "must be at least 1" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "new").exists()


def test_clustering_or_routing_without_sklearn_or_on_wordless_text_is_one_line(tmp_path, monkeypatch, capsys,
                                                                                 corpus, fitted):
    """Each ended in a traceback (exit 1); `experts eval --router` only after it had scored every expert."""
    from decentral.cli import main as cli_main

    data = tmp_path / "docs"
    data.mkdir()
    for i in range(6):
        (data / f"{i}.txt").write_text("a b " * (50 + i))  # (one-letter words: no term to embed)
    assert cli_main(["experts", "cluster", "--data", str(data), "--k", "2", "--out", str(tmp_path / "out")]) == 2
    assert "cannot cluster the documents" in capsys.readouterr().err
    fitted[0].save(tmp_path / "router.npz")
    for name in [m for m in sys.modules if m.split(".")[0] in ("sklearn", "scipy")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert cli_main(["experts", "cluster", "--data", str(data), "--k", "2", "--out", str(tmp_path / "o2")]) == 2
    assert "pip install 'decentral[cluster]'" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    (tmp_path / "reg").mkdir()
    code = cli_main(["experts", "eval", "--registry", str(tmp_path / "reg"), "--experts", "a,b,c", "--domain", "code",
                     "--router", str(tmp_path / "router.npz")])
    assert code == 2 and "pip install 'decentral[cluster]'" in capsys.readouterr().err
