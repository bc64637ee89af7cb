"""The network a SkipPipe plan is made for: nodes, the links between them, and the training shape.

A JSON file (times in milliseconds, bandwidths in megabits per second, 1 Mb = 10^6 bits):

    {
      "stages": 6, "skip": 0.33, "microbatches": 24, "activation_bytes": 33554432,
      "nodes": [{"name": "a", "compute_ms": 1760, "memory": 3, "stage": 0, "region": "eu", "uplink_mbps": 50}, ...],
      "links": [{"from": "a", "to": "b", "latency_ms": 1, "bandwidth_mbps": 2000, "both_ways": true}, ...],
      "default_link": {"latency_ms": 100, "bandwidth_mbps": 100},
      "backward_factor": 1.5, "loss_factor": 0.25
    }

`compute_ms` is a node's forward time for one microbatch of its stage; its backward takes
`backward_factor` times that and the loss (on a head) `loss_factor` times (optional; when absent,
the paper's cost model, 1.5 and 0.25 (ALGORITHMS.md §5): measure them for your model); `memory` is
how many microbatches' activations it may hold at once (default 3); `stage` pins the node to a
stage (optional); `region` is a label for plots (optional); `uplink_mbps` (optional) says the
node's messages share one uplink of that rate, whatever their destination: it sends one at a time,
in order (a home line, a VM's capped egress, a netlab host).
A link is one direction unless `both_ways`; pairs without a link take `default_link`, and a pair
with neither is an error. `activation_bytes` is the size of one microbatch's activations, and of
its gradient. `skip` is the share of stages a microbatch does not visit (see constraints.path_length).
That training shape (`stages`, `skip`, `microbatches`, `activation_bytes`) may be left out of a file whose
command gives it (`load_network(path, shape)`: `pipeline plan`'s flags, a run's recipe).

`regions_network` makes synthetic networks of nodes in a few regions, for tests and the benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MEMORY = 3  # microbatches resident per node (SkipPipe's TC1 default)
BACKWARD_FACTOR = 1.5  # a backward's time in forward times, when the file does not say (the paper's cost model)
LOSS_FACTOR = 0.25  # the loss's time on a head, in forward times
SHAPE_KEYS = ("stages", "skip", "microbatches", "activation_bytes")
FACTOR_KEYS = ("backward_factor", "loss_factor")
TOP_KEYS = {*SHAPE_KEYS, *FACTOR_KEYS, "nodes", "links", "default_link"}
NODE_KEYS = {"name", "compute_ms", "memory", "stage", "region", "uplink_mbps"}
LINK_KEYS = {"from", "to", "latency_ms", "bandwidth_mbps", "both_ways"}


class NetworkError(ValueError):
    """A network description or a planning request is invalid; the message names the field."""


class PipelineError(NetworkError):
    """A pipeline cannot run as asked: a stage left with no live node, a node that cannot start, a run
    folder without checkpoints. (A NetworkError, so `decentral` prints it as one line, exit code 2.)"""


@dataclass(frozen=True)
class Node:
    name: str
    compute_ms: float  # forward time of one microbatch
    memory: int = DEFAULT_MEMORY  # microbatches whose activations it may hold at once
    stage: int | None = None  # pinned stage, if any
    region: str = ""
    uplink_mbps: float | None = None  # one uplink for all its messages, when set


@dataclass(frozen=True, eq=False)
class Network:
    """Nodes, per ordered pair (i, j) a latency and a bandwidth, and the training shape.

    Nodes are referred to by their index in `nodes` everywhere in decentral.pipeline.
    """

    nodes: tuple[Node, ...]
    latency_ms: np.ndarray  # (n, n), [i, j] for messages from i to j; the diagonal is unused
    bandwidth_mbps: np.ndarray  # (n, n)
    stages: int
    skip: float
    microbatches: int
    activation_bytes: int
    source: str = "network"  # where it came from, for error messages
    backward_factor: float = BACKWARD_FACTOR  # backward time / forward time
    loss_factor: float = LOSS_FACTOR  # loss time on a head / its forward time
    send_ms: np.ndarray = field(init=False, repr=False)  # (n, n): the time a message holds its link (and uplink)
    transfer_ms: np.ndarray = field(init=False, repr=False)  # (n, n): send_ms + latency, one message on an idle link

    def __post_init__(self) -> None:
        uplink = np.array([node.uplink_mbps or np.inf for node in self.nodes])
        send = self.activation_bytes * 8 / (np.minimum(self.bandwidth_mbps, uplink[:, None]) * 1e3)
        transfer = self.latency_ms + send
        np.fill_diagonal(send, 0.0)
        np.fill_diagonal(transfer, 0.0)
        object.__setattr__(self, "send_ms", send)
        object.__setattr__(self, "transfer_ms", transfer)

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, name: str) -> int:
        for i, node in enumerate(self.nodes):
            if node.name == name:
                return i
        raise NetworkError(f"{self.source}: no node named {name!r}")

    def replace(self, **shape: Any) -> Network:
        """The same nodes and links with other `stages`, `skip`, `microbatches` or `activation_bytes` (None keeps).
        NetworkError when a node is pinned to a stage the new `stages` lacks."""
        checked = _check_shape(_overlaid({key: getattr(self, key) for key in SHAPE_KEYS}, shape), self.source)
        _check_pins(self.nodes, checked["stages"], self.source)
        return dataclasses.replace(self, **checked)

    def without(self, names: list[str] | tuple[str, ...]) -> Network:
        """The network with the nodes named `names` removed."""
        for name in names:
            self.index(name)
        gone = set(names)
        keep = [i for i, node in enumerate(self.nodes) if node.name not in gone]
        return dataclasses.replace(self, nodes=tuple(self.nodes[i] for i in keep),
                                   latency_ms=self.latency_ms[np.ix_(keep, keep)],
                                   bandwidth_mbps=self.bandwidth_mbps[np.ix_(keep, keep)])

    def with_measured_compute(self, compute: dict[str, dict]) -> Network:
        """The network with the compute its nodes measured ({name: {"forward", "loss", "backward"}}, mean
        ms per microbatch): each node's forward as its compute_ms; as the factors, the mean over nodes of
        backward / forward, and over heads of loss / forward. Nodes that measured nothing keep theirs."""
        measured = {name: m for name, m in compute.items() if m.get("forward")}
        backward = [m["backward"] / m["forward"] for m in measured.values() if m.get("backward")]
        loss = [m["loss"] / m["forward"] for m in measured.values() if m.get("loss")]
        nodes = tuple(dataclasses.replace(node, compute_ms=float(measured[node.name]["forward"]))
                      if node.name in measured else node for node in self.nodes)
        return dataclasses.replace(self, nodes=nodes,
                                   backward_factor=float(np.mean(backward)) if backward else self.backward_factor,
                                   loss_factor=float(np.mean(loss)) if loss else self.loss_factor)

    def to_json(self) -> dict:
        """The JSON form read by `parse_network`, every ordered pair as its own link."""
        nodes = [{key: value for key, value in vars(node).items() if value not in (None, "")} for node in self.nodes]
        links = [{"from": a.name, "to": b.name, "latency_ms": round(float(self.latency_ms[i, j]), 3),
                  "bandwidth_mbps": round(float(self.bandwidth_mbps[i, j]), 3)}
                 for i, a in enumerate(self.nodes) for j, b in enumerate(self.nodes) if i != j]
        return {"stages": self.stages, "skip": self.skip, "microbatches": self.microbatches,
                "activation_bytes": self.activation_bytes, "backward_factor": self.backward_factor,
                "loss_factor": self.loss_factor, "nodes": nodes, "links": links}

    def save(self, path: str | Path) -> Path:
        """Write `to_json()` with one node or link per line."""
        data = self.to_json()
        lines = [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in data.items()
                 if not isinstance(value, list)]
        for key in ("nodes", "links"):
            items = ",\n".join(f"  {json.dumps(item)}" for item in data[key])
            lines.append(f" {json.dumps(key)}: [\n{items}\n ],")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{\n" + "\n".join(lines).rstrip(",") + "\n}\n")
        return path


def load_network(path: str | Path, shape: dict[str, Any] | None = None) -> Network:
    """Read and validate a network file; every problem is a NetworkError naming the file and the field.
    `shape`: training-shape values (SHAPE_KEYS) that replace the file's, as `parse_network`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NetworkError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise NetworkError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise NetworkError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return parse_network(data, source=str(path), shape=shape)


def parse_network(data: Any, source: str = "network", shape: dict[str, Any] | None = None) -> Network:
    """Validate the JSON form (see the module docstring) into a Network. `shape`: values of SHAPE_KEYS that replace
    the file's where not None (a command's flags, a run's recipe); then the file need not give them."""
    if not isinstance(data, dict):
        raise NetworkError(f"{source}: expected a JSON object at the top, got {_kind(data)}")
    _no_unknown_keys(data, TOP_KEYS, source)
    shape = _check_shape(_overlaid({key: data.get(key) for key in SHAPE_KEYS}, shape or {}), source)
    factors = {}
    for key, default in zip(FACTOR_KEYS, (BACKWARD_FACTOR, LOSS_FACTOR)):
        factors[key] = data.get(key, default)
        if not _is_number(factors[key]) or factors[key] < 0:
            raise NetworkError(f"{source}: {key} must be a number >= 0, got {factors[key]!r}")
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        got = "an empty one" if raw_nodes == [] else _kind(raw_nodes)
        raise NetworkError(f"{source}: nodes must be a non-empty list, got {got}")
    nodes = tuple(_parse_node(raw, f"{source}: nodes[{i}]") for i, raw in enumerate(raw_nodes))
    _check_pins(nodes, shape["stages"], source)
    names = {}
    for i, node in enumerate(nodes):
        if node.name in names:
            raise NetworkError(f"{source}: nodes[{i}].name {node.name!r} is already used by nodes[{names[node.name]}]")
        names[node.name] = i
    count = len(nodes)
    latency = np.full((count, count), np.nan)
    bandwidth = np.full((count, count), np.nan)
    if data.get("default_link") is not None:
        default = _parse_link_cost(data["default_link"], f"{source}: default_link", extra=set())
        latency[:], bandwidth[:] = default
    links = data.get("links", [])
    if not isinstance(links, list):
        raise NetworkError(f"{source}: links must be a list, got {_kind(links)}")
    for k, raw in enumerate(links):
        where = f"{source}: links[{k}]"
        cost = _parse_link_cost(raw, where, extra={"from", "to", "both_ways"})
        ends = []
        for key in ("from", "to"):
            if not isinstance(raw.get(key), str) or raw[key] not in names:  # (a list, a mapping: unhashable)
                raise NetworkError(f"{where}.{key} must name a node, got {_shown(raw.get(key))}")
            ends.append(names[raw[key]])
        if ends[0] == ends[1]:
            raise NetworkError(f"{where}: from and to are the same node {raw['from']!r}")
        both = raw.get("both_ways", False)
        if not isinstance(both, bool):
            raise NetworkError(f"{where}.both_ways must be true or false, got {both!r}")
        for i, j in [tuple(ends)] + ([tuple(ends[::-1])] if both else []):
            latency[i, j], bandwidth[i, j] = cost
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    missing = np.argwhere(np.isnan(latency))
    if len(missing):
        i, j = missing[0]
        raise NetworkError(f"{source}: no link from {nodes[i].name!r} to {nodes[j].name!r} and no default_link "
                           f"({len(missing)} ordered pairs have none)")
    return Network(nodes, latency, bandwidth, source=source, **shape,
                   **{key: float(value) for key, value in factors.items()})


def regions_network(nodes: int = 20, regions: int = 5, seed: int = 0, stages: int = 6, skip: float = 0.33,
                    microbatches: int = 24, activation_bytes: int = 8 * 1024 * 1024 * 4,
                    compute_ms: float = 1760.0, speed_spread: tuple[float, float] = (0.7, 1.5),
                    memory: int = DEFAULT_MEMORY) -> Network:
    """A synthetic geo-distributed network: `nodes` spread over `regions` placed at random in a square.

    Inside a region links are about 1 ms / 2 Gb/s. Between regions the latency grows with distance,
    5 ms for neighbours up to 130 ms across the square's diagonal, and the bandwidth falls with it,
    75 Mb/s · (130 ms / latency)^0.65 (≈ 1.5 Gb/s at 5 ms, 75 Mb/s at 130 ms): the fit of the GCP
    measurements shipped with the SkipPipe reference. Each pair gets ±10% jitter per direction.
    Node speeds vary: forward time `compute_ms` times a factor drawn uniformly from `speed_spread`.
    The defaults follow the paper's setting: a 1.5B Llama split into 6 stages of 4 layers,
    microbatches of 8 sequences of 1024 tokens (1.76 s forward on its GPUs, 32 MiB of fp32
    activations). Every region gets at least one node.
    """
    if not 1 <= regions <= nodes:
        raise NetworkError(f"regions must be between 1 and the node count {nodes}, got {regions}")
    rng = np.random.default_rng(seed)
    places = rng.random((regions, 2))
    region_of = np.concatenate([rng.permutation(regions), rng.integers(0, regions, nodes - regions)])
    distance = np.linalg.norm(places[region_of][:, None, :] - places[region_of][None, :, :], axis=2)
    latency = 5.0 + 125.0 * distance / math.sqrt(2)
    bandwidth = np.minimum(75.0 * (130.0 / latency) ** 0.65, 2000.0)
    same = region_of[:, None] == region_of[None, :]
    latency[same], bandwidth[same] = 1.0, 2000.0
    latency *= rng.uniform(0.9, 1.1, latency.shape)
    bandwidth *= rng.uniform(0.9, 1.1, bandwidth.shape)
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    speeds = rng.uniform(*speed_spread, nodes)
    width = len(str(nodes - 1))
    members = tuple(Node(f"n{i:0{width}d}", round(float(compute_ms * speeds[i]), 1), memory, region=f"r{region_of[i]}")
                    for i in range(nodes))
    shape = _check_shape({"stages": stages, "skip": skip, "microbatches": microbatches,
                          "activation_bytes": activation_bytes}, "regions_network")
    return Network(members, latency, bandwidth, source=f"regions_network(seed={seed})", **shape)


def _overlaid(values: dict, shape: dict) -> dict:
    """`values` with `shape`'s values in place of theirs, where not None."""
    return {**values, **{key: value for key, value in shape.items() if value is not None}}


def _check_shape(values: dict, source: str) -> dict:
    missing = [key for key in SHAPE_KEYS if values.get(key) is None]
    if missing:
        raise NetworkError(f"{source}: {', '.join(missing)} missing: the training shape ({', '.join(SHAPE_KEYS)}) "
                           "comes from the file unless the command gives it (`pipeline plan`'s flags, a run's recipe)")
    stages, skip, microbatches, size = (values.get(key) for key in SHAPE_KEYS)
    if not _is_int(stages) or stages < 2:
        raise NetworkError(f"{source}: stages must be an integer >= 2, got {_shown(stages)}")
    if not _is_number(skip) or not 0 <= skip < 1:
        raise NetworkError(f"{source}: skip must be a number in [0, 1), got {_shown(skip)}")
    if not _is_int(microbatches) or microbatches < 1:
        raise NetworkError(f"{source}: microbatches must be a positive integer, got {_shown(microbatches)}")
    if not _is_number(size) or size < 0:
        raise NetworkError(f"{source}: activation_bytes must be a number >= 0, got {_shown(size)}")
    return dict(zip(SHAPE_KEYS, (int(stages), float(skip), int(microbatches), int(size))))


def _check_pins(nodes: tuple[Node, ...], stages: int, source: str) -> None:
    """NetworkError naming the first node pinned to a stage the pipeline's `stages` lack."""
    for i, node in enumerate(nodes):
        if node.stage is not None and node.stage >= stages:
            raise NetworkError(f"{source}: nodes[{i}] ({node.name!r}) is pinned to stage {node.stage}, but the "
                               f"pipeline has {stages} stages (0 to {stages - 1}): pin it to one of them, or ask for "
                               "more stages")


def _parse_node(raw: Any, where: str) -> Node:
    if not isinstance(raw, dict):
        raise NetworkError(f"{where} must be an object, got {_kind(raw)}")
    _no_unknown_keys(raw, NODE_KEYS, where)
    name, compute, memory = raw.get("name"), raw.get("compute_ms"), raw.get("memory", DEFAULT_MEMORY)
    stage, region, uplink = raw.get("stage"), raw.get("region", ""), raw.get("uplink_mbps")
    if not isinstance(name, str) or not name:
        raise NetworkError(f"{where}.name must be a non-empty string, got {_shown(name)}")
    if not _is_number(compute) or compute <= 0:
        raise NetworkError(f"{where}.compute_ms must be a positive number, got {_shown(compute)}")
    if not _is_int(memory) or memory < 1:
        raise NetworkError(f"{where}.memory must be a positive integer, got {memory!r}")
    if stage is not None and (not _is_int(stage) or stage < 0):
        raise NetworkError(f"{where}.stage must be an integer >= 0, got {stage!r}")
    if not isinstance(region, str):
        raise NetworkError(f"{where}.region must be a string, got {region!r}")
    if uplink is not None and (not _is_number(uplink) or uplink <= 0):
        raise NetworkError(f"{where}.uplink_mbps must be a positive number, got {uplink!r}")
    return Node(name, float(compute), int(memory), None if stage is None else int(stage), region,
                None if uplink is None else float(uplink))


def _parse_link_cost(raw: Any, where: str, extra: set[str]) -> tuple[float, float]:
    if not isinstance(raw, dict):
        raise NetworkError(f"{where} must be an object, got {_kind(raw)}")
    _no_unknown_keys(raw, {"latency_ms", "bandwidth_mbps"} | extra, where)
    latency, bandwidth = raw.get("latency_ms"), raw.get("bandwidth_mbps")
    if not _is_number(latency) or latency < 0:
        raise NetworkError(f"{where}.latency_ms must be a number >= 0, got {_shown(latency)}")
    if not _is_number(bandwidth) or bandwidth <= 0:
        raise NetworkError(f"{where}.bandwidth_mbps must be a positive number, got {_shown(bandwidth)}")
    return float(latency), float(bandwidth)


def _no_unknown_keys(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise NetworkError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # (an int of hundreds of digits, which no float holds)
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value as an error message shows it: "nothing" for a missing field (or null)."""
    return "nothing" if value is None else repr(value)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
