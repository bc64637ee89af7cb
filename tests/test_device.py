"""Where workers train: device names from recipes, and, on a machine with a GPU, real training on it
through a real NCCL island. (Without a GPU the CUDA tests are skipped; the rest of the suite then
covers the CPU path, and on a GPU machine every worker test runs on the GPU, since `auto` picks it.)"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from conftest import TINY_MODEL, TINY_TRAIN, free_port
from decentral.cli import main as cli_main
from decentral.config import parse_recipe
from decentral.data import eval_batches
from decentral.device import DeviceError, island_backend, pick_device
from decentral.loopback import LoopbackHub
from decentral.models import GPT, GPTConfig
from decentral.sync import PROTOCOLS, DiLoCo

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_auto_is_the_gpu_when_there_is_one_else_the_cpu():
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", "mps"])
def test_malformed_or_unsupported_device_names_are_clear_errors(spec):
    with pytest.raises(DeviceError, match="train.device"):
        pick_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_says_so():
    with pytest.raises(DeviceError, match="no GPU"):
        pick_device("cuda")


def test_an_island_on_the_cpu_uses_gloo_and_nccl_there_is_a_clear_error():
    cpu = torch.device("cpu")
    assert island_backend("auto", cpu, 2) == "gloo" and island_backend("gloo", cpu, 2) == "gloo"
    with pytest.raises(DeviceError, match="island.backend nccl needs a GPU per rank.*on the CPU"):
        island_backend("nccl", cpu, 1)


def test_train_with_a_bad_device_exits_2_and_names_it(tmp_path, small_corpus, capsys):
    code = cli_main(["train", "--protocol", "local", "--device", "tpu", "--data", str(small_corpus),
                     "--out", str(tmp_path), "--steps", "1"])
    assert code == 2
    assert "train.device 'tpu'" in capsys.readouterr().err


@needs_cuda
def test_slots_spread_over_the_gpus_and_batches_land_on_the_device():
    count = torch.cuda.device_count()
    assert [pick_device("auto", slot).index for slot in range(2 * count)] == [s % count for s in range(2 * count)]
    x, y = eval_batches(torch.arange(5000).remainder(256).to(torch.uint8).numpy(), batch_size=2, context=16,
                        num_batches=1, device="cuda")[0]
    assert x.is_cuda and y.is_cuda and torch.equal(x[:, 1:], y[:, :-1])


@needs_cuda
def test_diloco_outer_step_over_nccl_on_gpu_weights_equals_the_arithmetic_on_cpu():
    from decentral.island import IslandTransport

    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_MODEL)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fasts = []  # registered before the protocol's hook, so it sees the fast weights the outer step uses
    optimizer.register_step_post_hook(lambda *_: fasts.append(parameters_to_vector(model.parameters()).detach().cpu()))
    transport = IslandTransport(f"tcp://127.0.0.1:{free_port()}", 0, 1, backend="nccl", timeout=30.0)
    try:
        assert transport.backend == "nccl"
        with DiLoCo(model, optimizer, transport, every=3, outer_lr=0.7, outer_momentum=0.9) as sync:
            slow = sync.slow.clone()
            for _ in range(3):
                x = torch.randint(0, 256, (4, 32), device="cuda")
                model(x, x)[1].backward()
                optimizer.step()
                optimizer.zero_grad()
            report = sync.pop_report()
        assert report is not None and report.complete
    finally:
        transport.close()
    fast = fasts[-1]
    assert not torch.equal(fast, slow)
    reference = slow.clone().requires_grad_(True)  # torch's own SGD does the outer step independently
    reference.grad = slow - fast
    torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True).step()
    assert torch.allclose(sync.slow, reference.detach(), atol=1e-6)
    on_gpu = parameters_to_vector(model.parameters()).detach()
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), sync.slow)


@needs_cuda
def test_a_worker_trains_on_the_gpu_inside_an_nccl_island(tmp_path, small_corpus):
    from decentral.worker import WorkerOptions, run_worker

    recipe = parse_recipe({"protocol": {"name": "diloco", "every": 10, "outer_lr": 1.0, "outer_momentum": 0.5},
                           "train": {**TINY_TRAIN, "steps": 40, "device": "cuda"}, "model": TINY_MODEL,
                           "swarm": {"timeout": 30.0}})
    opts = WorkerOptions(out=tmp_path, data=[str(small_corpus)], island=f"tcp://127.0.0.1:{free_port()}",
                         rank=0, world_size=1, print_fn=lambda line: None)
    summary = run_worker(recipe, opts)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert summary["step"] == 40 and summary["round"] == 4
    assert vals[-1] < vals[0] - 0.5, vals


@needs_cuda
def test_an_island_uses_nccl_when_each_rank_has_its_own_gpu_and_gloo_when_they_share_one():
    count, gpu = torch.cuda.device_count(), torch.device("cuda", 0)
    assert island_backend("auto", gpu, count) == "nccl"
    assert island_backend("auto", gpu, count + 1) == "gloo"  # NCCL would refuse: "Duplicate GPU detected"
    with pytest.raises(DeviceError, match=f"{count + 1} ranks on this machine's {count} GPU"):
        island_backend("nccl", gpu, count + 1)


@needs_cuda
@pytest.mark.parametrize("name, args", [("diloco", {"every": 3}), ("co2", {"every": 3}),
                                        ("streaming", {"every": 6, "fragments": 2})])
def test_outer_state_on_the_gpu_steps_bit_for_bit_as_on_the_cpu(name, args):
    """Two replicas train on the GPU, one keeping its outer state there and one on the CPU: after every
    round they hold the same state, digest for digest (and so can trade states), and the first's is on the GPU."""
    hub = LoopbackHub(timeout_s=30.0)
    torch.manual_seed(0)
    models = [GPT(GPTConfig(**TINY_MODEL)).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    batches = [[torch.randint(0, 256, (4, 32), device="cuda") for _ in range(4 * args["every"])] for _ in range(2)]
    syncs, digests, errors = [], [[], []], []

    def work(i: int) -> None:
        optimizer = torch.optim.AdamW(models[i].parameters(), lr=1e-2)
        try:
            with PROTOCOLS[name](models[i], optimizer, transports[i], outer_on_device=(i == 0), **args) as sync:
                syncs.append(sync)
                for x in batches[i]:
                    models[i](x, x)[1].backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    report = sync.pop_report()
                    if report is not None and report.digest is not None:
                        digests[i].append((report.round, report.complete, report.digest))
        except Exception as e:  # noqa: BLE001 (re-raised by the test below)
            errors.append(e)

    transports = [hub.transport() for _ in range(2)]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(digests[0]) == 4 and all(complete for _, complete, _ in digests[0])
    assert digests[0] == digests[1]
    on_gpu = next(s for s in syncs if s.transport is transports[0])
    assert on_gpu.slow.is_cuda and all(t.is_cuda for t in on_gpu.outer_tensors().values())
