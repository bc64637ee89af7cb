"""c-BTM: discover domains by clustering documents, and route contexts to the cluster experts.

Gururangan et al. 2023, "Scaling Expert Language Models with Unsupervised Domain Discovery"
(arXiv 2303.14177). When documents carry no domain labels, c-BTM clusters them and trains one expert
per cluster; at inference a context is routed to the experts by its distance to the cluster centres.

- `fit_router(texts, k)` embeds the texts (hashed term counts -> tf-idf -> truncated SVD -> unit
  rows) and runs balanced k-means on the embeddings. It returns a `Router` and a balanced
  assignment: one cluster per text, cluster sizes differ by at most one.
- `Router.weights(texts, top_k)` gives each text the routing weights softmax(-d²/T) over the
  clusters, d² the squared Euclidean distance from the text's embedding to a centre (used once:
  the reference code squares it twice) and T = 0.1; with `top_k` only the top_k largest weights are
  kept and renormalised.
- `Router.save` / `Router.load` use one `.npz` of plain arrays (no pickle).

The hashing vectorizer is stateless, so a router holds only arrays: the idf weights, the SVD
components of the hashed terms the fit saw (the others' are zero) and the centres. scikit-learn
and scipy are optional dependencies of decentral
(`pip install 'decentral[cluster]'`); they are imported by the functions that need them.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

N_FEATURES = 2**18
TEMPERATURE = 0.1
FORMAT = 1
ARRAYS = ("meta", "idf", "feature_index", "components", "centres")
SKLEARN_MISSING = "c-BTM clustering needs scikit-learn: pip install 'decentral[cluster]'"


@contextmanager
def _needs_sklearn() -> Iterator[None]:
    """Turn a failed import of scikit-learn or scipy into an ImportError that says how to install them."""
    try:
        yield
    except ImportError as e:
        raise ImportError(SKLEARN_MISSING) from e


def check_sklearn() -> None:
    """ImportError saying how to install them unless scikit-learn and scipy import: for a command to call before
    its work, where `fit_router` or `Router.weights` would fail only once they run."""
    with _needs_sklearn():
        import scipy  # noqa: F401
        import sklearn  # noqa: F401


def _hashed_counts(texts: Sequence[str], n_features: int):
    """Term counts of `texts` hashed into `n_features` columns (a scipy CSR matrix)."""
    with _needs_sklearn():
        from sklearn.feature_extraction.text import HashingVectorizer
    return HashingVectorizer(n_features=n_features, alternate_sign=False, norm=None).transform(texts)


def _sq_distances(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances, (len(points), len(centres))."""
    with _needs_sklearn():
        from scipy.spatial.distance import cdist
    return cdist(points, centres, "sqeuclidean")


@dataclass(eq=False)
class Router:
    """Embeds texts and weights the k clusters for each: the c-BTM router.

    idf (n_features,): inverse document frequencies (smooth idf) of the hashed terms.
    feature_index (m,): the increasing columns (hashed terms) the fit saw; every other has zero components.
    components (dim, m): the truncated-SVD projection of tf-idf rows, on those columns.
    centres (k, dim): the cluster centres in the embedding space.
    temperature: T in softmax(-d²/T).
    """

    idf: np.ndarray
    feature_index: np.ndarray
    components: np.ndarray
    centres: np.ndarray
    temperature: float = TEMPERATURE

    def __post_init__(self) -> None:
        self.idf = np.asarray(self.idf, dtype=np.float64)
        self.feature_index = np.asarray(self.feature_index)
        self.components = np.asarray(self.components, dtype=np.float64)
        self.centres = np.asarray(self.centres, dtype=np.float64)
        self.temperature = float(self.temperature)
        if self.idf.ndim != 1 or len(self.idf) < 2:
            raise ValueError(f"idf must be a vector of at least 2 features, not shape {self.idf.shape}")
        index = self.feature_index
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise ValueError("feature_index must be a vector of integers")
        if len(index) and (index[0] < 0 or index[-1] >= len(self.idf) or np.any(np.diff(index) <= 0)):
            raise ValueError(f"feature_index must be increasing and within [0, {len(self.idf)})")
        if self.components.ndim != 2 or self.components.shape[1] != len(index) or len(self.components) < 1:
            raise ValueError(f"components must have shape (dim, {len(index)}), not {self.components.shape}")
        if self.centres.ndim != 2 or self.centres.shape[1] != self.dim or len(self.centres) < 1:
            raise ValueError(f"centres must have shape (k, {self.dim}), not {self.centres.shape}")
        for name in ("idf", "components", "centres"):
            if not np.all(np.isfinite(getattr(self, name))):
                raise ValueError(f"{name} has non-finite values")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive number, not {self.temperature}")

    @property
    def k(self) -> int:
        """The number of clusters."""
        return len(self.centres)

    @property
    def dim(self) -> int:
        """The dimension of the embeddings."""
        return len(self.components)

    def tfidf(self, texts: Sequence[str]) -> csr_matrix:
        """The tf-idf rows of `texts` (l2-normalised), as `TfidfTransformer.transform` gives them with this idf."""
        with _needs_sklearn():
            from scipy.sparse import csr_matrix
            from sklearn.preprocessing import normalize
        if len(texts) == 0:
            return csr_matrix((0, len(self.idf)))
        counts = _hashed_counts(texts, len(self.idf))
        counts.data *= self.idf[counts.indices]
        return normalize(counts, copy=False)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """The unit-length embeddings of `texts`, (n, dim): tf-idf rows projected on the components."""
        with _needs_sklearn():
            from sklearn.preprocessing import normalize
        if len(texts) == 0:
            return np.zeros((0, self.dim))
        return normalize(np.asarray(self.tfidf(texts)[:, self.feature_index] @ self.components.T))

    def sq_distances(self, texts: Sequence[str]) -> np.ndarray:
        """Squared Euclidean distances from each text's embedding to each centre, (n, k)."""
        return _sq_distances(self.embed(texts), self.centres)

    def weights(self, texts: Sequence[str], top_k: int | None = None, temperature: float | None = None) -> np.ndarray:
        """Routing weights (n, k), rows summing to 1: softmax(-d²/T) over the clusters.

        With `top_k`, only each row's top_k largest weights are kept (renormalised), the rest are 0.
        `temperature` overrides the router's T.
        """
        temperature = self.temperature if temperature is None else float(temperature)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a positive number, not {temperature}")
        if top_k is not None and not 1 <= top_k <= self.k:
            raise ValueError(f"top_k must be between 1 and k={self.k}, not {top_k}")
        logits = -self.sq_distances(texts) / temperature
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        if top_k is not None and top_k < self.k:
            dropped = np.argpartition(weights, self.k - top_k - 1, axis=1)[:, : self.k - top_k]
            np.put_along_axis(weights, dropped, 0.0, axis=1)
        return weights / weights.sum(axis=1, keepdims=True)

    def assign(self, texts: Sequence[str]) -> np.ndarray:
        """The nearest centre of each text (not balanced: this is routing, not clustering)."""
        return np.argmin(self.sq_distances(texts), axis=1)

    def save(self, path: str | Path) -> None:
        """Write the router to one `.npz` at `path` (exactly that name)."""
        meta = {"format": FORMAT, "temperature": self.temperature}
        with open(path, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), idf=self.idf, feature_index=self.feature_index,
                     components=self.components, centres=self.centres)

    @classmethod
    def load(cls, path: str | Path) -> Router:
        """Read a router written by `save`; ValueError when the file is not one."""
        try:
            return cls._from_arrays(_read_npz(path))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a router file: {e}") from None

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray]) -> Router:
        missing = set(ARRAYS) - set(arrays)
        if missing:
            raise ValueError(f"missing arrays {sorted(missing)}")
        meta = json.loads(str(arrays["meta"]))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} router")
        temperature = meta.get("temperature")
        if not isinstance(temperature, (int, float)):
            raise ValueError("meta needs a number temperature")
        return cls(idf=arrays["idf"], feature_index=arrays["feature_index"], components=arrays["components"],
                   centres=arrays["centres"], temperature=temperature)


def _read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of the `.npz` at `path`, without unpickling; ValueError when it is not a readable `.npz`."""
    with open(path, "rb") as f:
        try:
            npz = np.load(f, allow_pickle=False)
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive")
            with npz:
                return {name: npz[name] for name in npz.files}
        except (OSError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(str(e) or type(e).__name__) from None


def fit_router(
    texts: Sequence[str], k: int, *, dim: int = 64, seed: int = 0, max_iter: int = 50, fit_sample: int = 2000
) -> tuple[Router, np.ndarray]:
    """Cluster `texts` into `k` balanced clusters; return the router and each text's cluster (int array).

    The embedding (tf-idf idf; SVD to min(dim, texts fitted - 1, distinct terms - 1) components)
    and the centres (balanced k-means, k-means++ init, at most `max_iter` rounds) are fitted on all
    texts when there are at most `fit_sample`, else on a random sample of `fit_sample` texts that the
    rest are then assigned to (see `_assign_in_chunks`). Cluster sizes differ by at most one:
    floor(n/k) or ceil(n/k) texts each. Deterministic given `seed`. ValueError on bad arguments, and
    when fewer than two texts (or distinct terms) leave nothing to embed.
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a sequence of strings, not one string")
    n = len(texts)
    if n == 0:
        raise ValueError("no texts to cluster")
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    if k > n:
        raise ValueError(f"cannot make k={k} clusters of {n} texts")
    if dim < 1 or max_iter < 1:
        raise ValueError(f"dim and max_iter must be at least 1, not {dim} and {max_iter}")
    if fit_sample < k:
        raise ValueError(f"fit_sample={fit_sample} must be at least k={k}")
    with _needs_sklearn():
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfTransformer
        from sklearn.preprocessing import normalize

    rng = np.random.default_rng(seed)
    fitted = range(n) if n <= fit_sample else np.sort(rng.choice(n, size=fit_sample, replace=False))
    counts = _hashed_counts([texts[i] for i in fitted], N_FEATURES)
    tfidf = TfidfTransformer().fit(counts)
    rows = tfidf.transform(counts)
    # The SVD of the columns of terms the fit saw equals that of all columns (the others get zero
    # components), and is much cheaper: ARPACK is exact up to its tolerance, so the result matches
    # TruncatedSVD(algorithm="arpack") on the full matrix.
    seen = np.flatnonzero(rows.getnnz(axis=0))
    n_components = min(dim, len(fitted) - 1, len(seen) - 1)
    if n_components < 1:
        raise ValueError("cannot embed fewer than two texts, or texts with fewer than two distinct terms")
    svd = TruncatedSVD(n_components=n_components, algorithm="arpack", random_state=seed).fit(rows[:, seen])
    centres, assignment = _balanced_kmeans(normalize(svd.transform(rows[:, seen])), k, seed, max_iter)
    router = Router(idf=tfidf.idf_, feature_index=seen, components=svd.components_, centres=centres)
    if n > fit_sample:
        assignment = _assign_in_chunks(router, texts, chunk=fit_sample - fit_sample % k, rng=rng)
    return router, assignment


def _balanced_kmeans(points: np.ndarray, k: int, seed: int, max_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced k-means: (centres (k, dim), assignment (n,)), centres the means of their members."""
    with _needs_sklearn():
        from sklearn.cluster import kmeans_plusplus
    centres, _ = kmeans_plusplus(points, k, random_state=seed)
    assignment = None
    for _ in range(max_iter):
        new = _balanced_assignment(_sq_distances(points, centres))
        if assignment is not None and np.array_equal(new, assignment):
            break
        assignment = new
        centres = np.stack([points[assignment == j].mean(axis=0) for j in range(k)])
    return centres, assignment


def _balanced_assignment(sq_dist: np.ndarray) -> np.ndarray:
    """The assignment of m points to k clusters minimising the total squared distance, exactly,
    subject to every cluster getting floor(m/k) or ceil(m/k) points.

    A square linear-sum-assignment problem: each cluster offers floor(m/k) slots that must be filled
    and, when k does not divide m, one optional slot; k - m % k dummy rows (cost 0 on optional slots,
    forbidden on the others) take the optional slots left over.
    """
    with _needs_sklearn():
        from scipy.optimize import linear_sum_assignment
    m, k = sq_dist.shape
    base, extra = divmod(m, k)
    slot_cluster = np.repeat(np.arange(k), base)
    cost = sq_dist[:, slot_cluster]
    if extra:
        slot_cluster = np.concatenate([slot_cluster, np.arange(k)])
        dummies = np.zeros((k - extra, len(slot_cluster)))
        dummies[:, : base * k] = np.inf
        cost = np.vstack([np.hstack([cost, sq_dist]), dummies])
    _, slots = linear_sum_assignment(cost)
    return slot_cluster[slots[:m]]


def _assign_in_chunks(router: Router, texts: Sequence[str], chunk: int, rng: np.random.Generator) -> np.ndarray:
    """Balanced assignment of all texts to the router's centres, exact within random chunks.

    The exact assignment of all n texts is an n x n problem (n² memory, about n³ time), so the texts
    are shuffled and split into chunks of `chunk` texts (a multiple of k), each assigned exactly by
    `_balanced_assignment`. Every full chunk gives each cluster exactly chunk/k texts and the last
    one floor or ceil of its size/k, so the totals still differ by at most one.
    """
    order = rng.permutation(len(texts))
    assignment = np.empty(len(texts), dtype=np.int64)
    for start in range(0, len(texts), chunk):
        members = order[start : start + chunk]
        assignment[members] = _balanced_assignment(router.sq_distances([texts[i] for i in members]))
    return assignment
