"""Merge benchmark: the time and peak memory of a merge, against reading its inputs once.

`run_merge_bench(out, params=100_000_000, experts=4, method="linear")`:

1. Writes `experts` random expert folders (and a base when the method needs one) with the tensor
   names and shapes of a decentral.models.GPT of about `params` float32 parameters (d_model a
   multiple of 64 near sqrt(params / 96), n_layer to fill the rest). Tensors are random (the base
   N(0, 0.02²), each expert the base plus N(0, 0.002²)) and streamed to disk one at a time.
2. Reads every input file once, so that both measured passes find them in the page cache: the
   comparison is between warm reads, not a cold read against a warm merge (`cold=True` instead
   drops the page cache before each pass; Linux, root).
3. Runs `repeats` times, each pass in a fresh Python process so that its peak RSS is its own:
   (a) the read pass, `SafetensorsReader.get` of every tensor of every input once; (b) the merge as
   `decentral merge` runs it by default, the output hashed as it is written (the inputs' sha256 is
   checked only with `--verify`: the read pass times that check alone).
   Each resets its peak RSS after its imports and reports that baseline, its wall time and its peak.
   The read pass also times checking every input's sha256 alone, what `--verify` adds to a merge.

Reports the fastest time and the largest peak of each pass, writes OUT/results.json and
OUT/merge_bench.png and prints a table. The issue's targets: peak RSS above the baseline ≤ 1.5 × one
model's size; merge time < 2 × read time. The generated models are deleted afterwards.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from decentral.experts.registry import MODEL_FILE, Expert, write_expert
from decentral.merge import METHODS, MergeError
from decentral.merge.tensors import SafetensorsWriter
from decentral.metrics import human_bytes, results_folder
from decentral.models import GPT, GPTConfig

MEMORY_TARGET = 1.5  # peak RSS above baseline, in models
TIME_TARGET = 2.0  # merge time, in read times
BASE_STD, EXPERT_STD = 0.02, 0.002


def bench_config(params: int) -> GPTConfig:
    """A GPT shape of about `params` parameters: d_model a multiple of 64, 12·d_model² per layer."""
    d_model = max(64, 64 * round(math.sqrt(params / 96) / 64))
    n_layer = max(1, round(params / (12 * d_model**2)))
    return GPTConfig(vocab_size=256, context=128, n_layer=n_layer, n_head=d_model // 64, d_model=d_model)


def model_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The state dict's tensor names and shapes, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}


def write_random_experts(root: Path, config: GPTConfig, names: list[str], seed: int = 0) -> list[Expert]:
    """One expert folder per name under `root`, the first the base (N(0, 0.02²) per entry), the others
    the base plus N(0, 0.002²); a tensor at a time, so memory holds two tensors, not a model."""
    shapes = model_shapes(config)
    specs = {name: ("F32", shape) for name, shape in shapes.items()}
    number = {name: i for i, name in enumerate(sorted(shapes))}

    def tensor(name: str, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + number[name])
        values = torch.randn(shapes[name], generator=generator).mul_(BASE_STD)
        if index:
            generator.manual_seed(seed * 1_000_003 + len(shapes) * index + number[name])
            values.add_(torch.randn(shapes[name], generator=generator), alpha=EXPERT_STD)
        return values

    def writer_for(index: int):
        def write(path: Path) -> str:
            with SafetensorsWriter(path, specs) as writer:
                for name in writer.order:
                    writer.write(name, tensor(name, index))
                return writer.close()
        return write

    return [write_expert(root / name, writer_for(index),
                         Expert(name=name, sha256="", size=0, model=asdict(config), steps=index, tokens=0))
            for index, name in enumerate(names)]


def _warm(files: list[Path]) -> None:
    buffer = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _measure(mode: str, job: dict) -> dict:
    """In a fresh process: the pass `mode` ("read" or "merge") of `job`; its time and RSS."""
    child = "import sys; from decentral.merge.bench import _child; _child(sys.argv[1], sys.argv[2])"
    cmd = [sys.executable, "-c", child, mode, json.dumps(job)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"merge bench: the {mode} pass failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reset_peak_rss() -> bool:
    """Make this process's peak RSS its current RSS (Linux: write 5 to /proc/self/clear_refs); False
    where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM on Linux, where ru_maxrss never reads below the peak of
    the process that started this one (it carries over exec: a child of a 2 GB parent reports 2 GB);
    ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _child(mode: str, job_json: str) -> None:
    """One measured pass, after every import it needs; prints its time and RSS as a JSON line. The
    peak is reset after the imports, which peak above what the process then holds."""
    from decentral.experts.registry import read_expert, verify_expert
    from decentral.merge import merge, parse_merge_recipe
    from decentral.merge.tensors import SafetensorsReader

    job = json.loads(job_json)
    if job.get("cold"):
        _drop_page_cache()
    result = {"rss_peak_reset": reset_peak_rss(), "rss_baseline": peak_rss()}
    started = time.perf_counter()
    if mode == "read":
        for folder in job["folders"]:
            with SafetensorsReader(Path(folder) / MODEL_FILE) as reader:
                for name in reader.tensors:
                    reader.get(name)
    else:
        merge(parse_merge_recipe(job["recipe"], "merge bench"), job["out"], progress=False)
    result["time_s"] = time.perf_counter() - started
    result["rss_peak"] = peak_rss()
    if mode == "read":  # what checking the inputs' sha256 costs alone, files in the page cache
        started = time.perf_counter()
        for folder in job["folders"]:
            verify_expert(read_expert(folder))
        result["time_verify_s"] = time.perf_counter() - started
    print(json.dumps(result))


def _drop_page_cache() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError as e:
        raise RuntimeError(f"merge bench: cold runs drop the page cache, which needs root on Linux: {e}") from None


def smallest_params() -> int:
    """The parameters of the smallest model the bench builds (`bench_config` of any count up to it)."""
    return sum(math.prod(shape) for shape in model_shapes(bench_config(1)).values())


def run_merge_bench(out: Path, *, params: int = 100_000_000, experts: int | None = None, method: str = "linear",
                    repeats: int = 2, cold: bool = False) -> dict:
    """Build the inputs, time and measure a read pass and the merge (the fastest of `repeats` runs of
    each, and the largest peak); write results.json and a plot into `out`; print a table. `experts`
    defaults to the number the method merges (4 where it takes any). `cold` drops the page cache before
    each pass instead of warming it (Linux, root). MergeError for settings the bench cannot run."""
    if method not in METHODS:
        raise MergeError(f"merge bench: unknown method {method!r}; choose from {sorted(METHODS)}")
    merge_method = METHODS[method]
    if experts is None:
        experts = merge_method.num_models or max(4, merge_method.min_models)
    if experts < merge_method.min_models or merge_method.num_models not in (None, experts):
        wanted = (f"exactly {merge_method.num_models}" if merge_method.num_models
                  else f"{merge_method.min_models} or more")
        raise MergeError(f"merge bench: {method} merges {wanted} experts, not {experts}")
    if params < smallest_params():
        raise MergeError(f"merge bench: --params {params:,} is below the smallest model the bench builds "
                         f"({smallest_params():,} parameters)")
    if repeats < 1:
        raise MergeError(f"merge bench: repeats must be at least 1, got {repeats}")
    out = Path(out)
    with results_folder(out, "bench merge"):
        config = bench_config(params)
        data = out / f".merge-bench-{uuid.uuid4().hex[:8]}"
        try:
            names = (["base"] if merge_method.needs_base else []) + [f"expert{i}" for i in range(experts)]
            print(f"merge bench: writing {len(names)} random models of about {params:,} parameters "
                  f"(n_layer {config.n_layer}, d_model {config.d_model}) ...", flush=True)
            inputs = write_random_experts(data / "inputs", config, names)
            folders = [str(expert.folder) for expert in inputs]
            recipe = {"method": method, "experts": folders[-experts:]}
            if merge_method.needs_base:
                recipe["base"] = folders[0]
            if not cold:
                _warm([expert.model_file for expert in inputs])
            reads, merges = [], []
            for run in range(repeats):
                print(f"merge bench: read pass, merge pass ({run + 1}/{repeats}) ...", flush=True)
                reads.append(_measure("read", {"folders": folders, "cold": cold}))
                merges.append(_measure("merge", {"recipe": recipe, "out": str(data / "merged"), "cold": cold}))
                model_bytes = (data / "merged" / MODEL_FILE).stat().st_size
                shutil.rmtree(data / "merged")  # not replaced inside the next timed merge
        finally:
            shutil.rmtree(data, ignore_errors=True)
        results = {
            "config": {"method": method, "experts": experts, "inputs": len(inputs),
                       "params": sum(math.prod(s) for s in model_shapes(config).values()),
                       "n_layer": config.n_layer, "d_model": config.d_model, "dtype": "float32", "repeats": repeats,
                       "date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                       "python": platform.python_version(), "torch": torch.__version__,
                       "cache": "cold: page cache dropped before each pass" if cold else
                                "warm: every input read once before the passes",
                       "rss_peak_reset": all(r["rss_peak_reset"] for r in reads + merges)},
            "model_bytes": model_bytes,
            "time_read_s": min(r["time_s"] for r in reads),
            "time_merge_s": min(m["time_s"] for m in merges),
            "time_verify_inputs_s": min(r["time_verify_s"] for r in reads),
            "rss_baseline_bytes": max(m["rss_baseline"] for m in merges),
            "rss_read_above_baseline_bytes": max(r["rss_peak"] - r["rss_baseline"] for r in reads),
            "rss_merge_above_baseline_bytes": max(m["rss_peak"] - m["rss_baseline"] for m in merges),
        }
        results["time_ratio"] = results["time_merge_s"] / results["time_read_s"]
        results["memory_ratio"] = results["rss_merge_above_baseline_bytes"] / model_bytes
        results["targets"] = {"time_ratio_max": TIME_TARGET, "memory_ratio_max": MEMORY_TARGET,
                              "time_ok": results["time_ratio"] < TIME_TARGET,
                              "memory_ok": results["memory_ratio"] <= MEMORY_TARGET}
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot_merge_bench(results, out / "merge_bench.png")
        print(format_merge_bench(results))
        return results


def plot_merge_bench(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), layout="constrained")
    times, memory = fig.subplots(1, 2)
    times.bar(["read once", "input sha256 alone", "merge"],
              [results["time_read_s"], results["time_verify_inputs_s"], results["time_merge_s"]],
              color=["C0", "C7", "C1"])
    times.axhline(TIME_TARGET * results["time_read_s"], color="C3", ls="--", label=f"target: {TIME_TARGET:g}× read")
    times.set(ylabel="seconds", title="wall time")
    mib = 1 << 20
    memory.bar(["one model", "read peak", "merge peak"],
               [results["model_bytes"] / mib, results["rss_read_above_baseline_bytes"] / mib,
                results["rss_merge_above_baseline_bytes"] / mib], color=["C7", "C0", "C1"])
    memory.axhline(MEMORY_TARGET * results["model_bytes"] / mib, color="C3", ls="--",
                   label=f"target: {MEMORY_TARGET:g}× model")
    memory.set(ylabel="MiB", title="peak RSS above the baseline after imports")
    for ax in (times, memory):
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
    cfg = results["config"]
    fig.suptitle(f"{cfg['method']} merge of {cfg['experts']} experts, {cfg['params']:,} float32 parameters each")
    fig.savefig(out_png, dpi=110)
    return out_png


def format_merge_bench(results: dict) -> str:
    cfg, targets = results["config"], results["targets"]
    rss = {key: human_bytes(results[f"rss_{key}_above_baseline_bytes"]) for key in ("read", "merge")}
    verdict = {True: "ok", False: "MISSED"}
    rows = [
        ("model size", human_bytes(results["model_bytes"]), f"{cfg['params']:,} float32 parameters, {cfg['inputs']} inputs"),
        ("read once", f"{results['time_read_s']:.2f} s", f"peak RSS +{rss['read']}"),
        ("merge", f"{results['time_merge_s']:.2f} s",
         f"peak RSS +{rss['merge']} (baseline after imports {human_bytes(results['rss_baseline_bytes'])})"),
        ("input sha256 alone", f"{results['time_verify_inputs_s']:.2f} s", "hashing every input: what --verify adds"),
        ("merge / read time", f"{results['time_ratio']:.2f}x",
         f"target < {TIME_TARGET:g}x: {verdict[targets['time_ok']]}"),
        ("merge peak / model", f"{results['memory_ratio']:.2f}x",
         f"target <= {MEMORY_TARGET:g}x: {verdict[targets['memory_ok']]}"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a.ljust(widths[0])}  {b.rjust(widths[1])}  {c}" for a, b, c in rows)


def add_arguments(parser) -> None:
    """`decentral bench merge`."""
    from decentral.cli import number_type, positive_int

    parser.add_argument("--params", type=positive_int, default=100_000_000,
                        help="parameters per model (default 100M; at least the smallest model's, about 91k)")
    parser.add_argument("--experts", type=number_type(int, 2), help="models merged, 2 or more (default: 4, or the "
                        "number the method merges: slerp 2)")
    parser.add_argument("--method", default="linear", choices=sorted(m for m in METHODS if not METHODS[m].weights_from))
    parser.add_argument("--repeats", type=positive_int, default=2, help="passes of each kind; the fastest counts")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each pass (Linux, root): "
                        "reads come from the disk")
    parser.add_argument("--out", default="runs/bench-merge")
    parser.set_defaults(func=lambda args: 0 if run_merge_bench(Path(args.out), params=args.params, experts=args.experts,
                                                               method=args.method, repeats=args.repeats,
                                                               cold=args.cold) else 1)
