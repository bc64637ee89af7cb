"""Codecs (decentral.codec): exact sizes, the error bound each one states, malformed bytes refused; then
averages in each codec between real swarm peers, and error feedback that loses nothing over rounds."""

import math

import numpy as np
import pytest
import torch

from conftest import run_in_threads
from decentral.codec import CODECS, CodecError, make_codec
from decentral.sync import CO2, DiLoCo, NoLoCo
from test_protocols import flat, make_protocols, outer_round

SIZES = [0, 1, 7, 255, 256, 257, 4095, 4096, 4097, 10_000]


def blockwise_bound(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """Per element: its block's max |x| / (2·levels), the bound int8 and int4 state."""
    pad = (-x.numel()) % block
    scales = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(-1, block).amax(dim=1)
    return (scales / (2 * levels)).repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("spec", [*CODECS, "topk:0.05"])
def test_every_encoding_has_the_announced_size_and_decodes_to_what_round_trip_says(spec):
    codec = make_codec(spec)
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = torch.randn(n, generator=gen) * 0.01
        data = codec.encode(x)
        assert len(data) == codec.size(n), (spec, n)
        decoded = codec.decode(data, n)
        assert decoded.dtype == torch.float32 and decoded.shape == (n,)
        assert torch.equal(decoded, codec.round_trip(x))


@pytest.mark.parametrize("spec", [*CODECS, "topk:0.05", "topk:0.050", "topk:1"])
def test_a_codecs_spec_makes_the_same_codec_and_names_it_one_way(spec):
    """What a member publishes of its codec (its setup: decentral.worker) compares equal exactly when the codecs
    are: top-k's density included, however the recipe wrote it."""
    codec = make_codec(spec)
    assert make_codec(codec.spec) == codec and make_codec(codec.spec).spec == codec.spec
    assert codec.spec == {"topk": "topk:0.01", "topk:0.050": "topk:0.05"}.get(spec, spec)


def test_dense_and_blockwise_codecs_stay_within_their_stated_error_bounds():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=gen) * torch.logspace(-4, 1, 10_000)  # magnitudes over 5 decades
    assert torch.equal(make_codec("float32").round_trip(x), x)
    for name, unit, tiny in (("float16", 2.0 ** -11, 2.0 ** -25), ("bfloat16", 2.0 ** -8, 0.0)):
        err = (make_codec(name).round_trip(x) - x).abs()
        assert bool((err <= unit * x.abs() + tiny).all()), name
    for name, block, levels in (("int8", 256, 127), ("int4", 128, 7)):
        codec = make_codec(name)
        assert (codec.block, codec.levels) == (block, levels)
        err = (codec.round_trip(x) - x).abs()
        bound = blockwise_bound(x, block, levels)
        assert bool((err <= bound * (1 + 1e-5)).all()), name
        assert float(err.max()) > 0.3 * float(bound.max())  # the bound is tight, not vacuous


def test_topk_keeps_the_largest_of_each_chunk_with_a_sign_and_its_groups_mean_magnitude():
    codec = make_codec("topk:0.02")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3 * 4096 + 1000, generator=gen)
    decoded = codec.round_trip(x)
    for start in range(0, x.numel(), 4096):
        part, got = x[start:start + 4096], decoded[start:start + 4096]
        k = math.ceil(0.02 * part.numel())
        kept = set(part.abs().argsort(descending=True)[:k].tolist())
        assert set(got.nonzero().flatten().tolist()) == kept  # no ties in random normals
        where = torch.tensor(sorted(kept))
        assert torch.equal(torch.sign(got[where]), torch.sign(part[where]))
        magnitude = part[where].abs()
        high = magnitude > magnitude.mean()
        for group in (high, ~high):
            mean = magnitude[group].mean().to(torch.bfloat16).float()
            assert torch.equal(got[where][group].abs(), mean.expand(int(group.sum())))
        # the error off the support is at most the smallest kept magnitude; on it, the group's spread
        assert float(part[[i for i in range(part.numel()) if i not in kept]].abs().max()) <= float(magnitude.min())
    assert codec.size(x.numel()) * 8 / x.numel() < 0.4  # bits per value, indices included
    assert make_codec("topk").size(100 * 4096) * 8 / (100 * 4096) < 0.12  # 1%: 8.6 bits a position, not 12


def test_codecs_refuse_bytes_that_encode_nothing_valid():
    x = torch.randn(600)
    for spec in CODECS:
        codec = make_codec(spec)
        with pytest.raises(CodecError, match="bytes"):
            codec.decode(codec.encode(x)[:-1], 600)
    int8 = make_codec("int8")
    data = bytearray(int8.encode(x))
    data[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        int8.decode(bytes(data), 600)
    data = bytearray(int8.encode(x))
    data[-1] = 0x80  # code -128: outside ±127, beyond the scale's bound
    with pytest.raises(CodecError, match="code"):
        int8.decode(bytes(data), 600)
    topk = make_codec("topk:0.01")
    good = topk.encode(x)  # a chunk's 4 bytes of magnitudes; 6 positions: their low 6 bits, then a bitmap of
    # 16 slots where position i sets slot (position >> 6) + i; then 2 bits each
    for bitmap in ([1] * 7 + [0] * 9, [1] * 6 + [0] * 10, [0] * 10 + [1] * 6):  # 7 positions; 6 times 0; 640 and up
        bits = np.unpackbits(np.frombuffer(good, np.uint8))
        bits[32:32 + 36], bits[32 + 36:32 + 52] = 0, bitmap
        with pytest.raises(CodecError, match="positions"):
            topk.decode(np.packbits(bits).tobytes(), 600)
    for bad in ("int3", "topk:2", "topk:x", "float16:1"):
        with pytest.raises(ValueError, match="codec|density"):
            make_codec(bad)


@pytest.mark.parametrize("spec", ["float16", "int8", "int4"])
def test_a_swarm_average_in_a_dense_codec_is_within_its_bound_of_the_exact_mean(make_swarm, spec):
    codec = make_codec(spec)
    peers = make_swarm(3, codec=spec)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3000, generator=gen) for _ in peers]
    ids = sorted(p.peer_id for p in peers)
    results = run_in_threads([lambda p=p, x=x: p.average(x, ids, "codec/0") for p, x in zip(peers, inputs)])
    assert all(r.complete for r in results)
    assert all(torch.equal(r.tensor, results[0].tensor) for r in results)
    exact = torch.stack(inputs).mean(0)
    # each part rounded once (phase 1), the owner's mean once more (phase 2): at most twice the bound of
    # the largest value, relative (float16) or per block (int8, int4)
    largest = torch.stack(inputs).abs().amax(0)
    if spec == "float16":
        bound = 2 * 2.0 ** -11 * largest + 1e-7
    else:
        bound = 2 * largest.max() / (2 * codec.levels)
    assert bool(((results[0].tensor - exact).abs() <= bound).all())
    assert float((results[0].tensor - exact).abs().max()) > 0  # the codec really rounded


@pytest.mark.solo
def test_a_topk_swarm_average_is_exactly_the_mean_of_what_it_counted_of_each_member(make_swarm):
    peers = make_swarm(3, codec="topk:0.05")
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(9000, generator=gen) for _ in peers]
    ids = sorted(p.peer_id for p in peers)
    results = run_in_threads([lambda p=p, x=x: p.average(x, ids, "topk/0") for p, x in zip(peers, inputs)])
    assert all(r.complete and torch.equal(r.tensor, results[0].tensor) for r in results)
    counted = torch.stack([r.sent for r in results]).mean(0)
    torch.testing.assert_close(results[0].tensor, counted, rtol=0, atol=1e-6)
    dropped = results[0].tensor == 0
    for r, x in zip(results, inputs):  # what the owners' re-encoding dropped stays with its sender, nobody else
        assert not bool(r.sent[dropped].any())
        assert bool(((x - r.sent)[dropped] == x[dropped]).all())
    nonzero = int((results[0].tensor != 0).sum())
    assert nonzero <= 0.05 * 9000 + 3  # the owners re-encoded their means at the same density
    sent = [len(make_codec("topk:0.05").encode(x)) for x in inputs]
    assert max(p.bytes_sent for p in peers) < 2 * max(sent) + 10_000  # both phases, headers and heartbeats


@pytest.mark.parametrize("protocol", [DiLoCo, CO2])
def test_error_feedback_loses_nothing_over_rounds(make_swarm, protocol):
    """With outer lr 1 and no momentum, φ0 − φ is the sum of the rounds' averages; what they did not
    count stays in each peer's residual: φ0 − φ + mean(residual) = the mean of all true outer gradients."""
    kwargs = {"outer_momentum": 0.0, "outer_lr": 1.0, **({"clip": None} if protocol is CO2 else {})}
    protocols = make_protocols(make_swarm(3, codec="topk:0.1"), protocol, every=10, **kwargs)
    phi0 = protocols[0].slow.clone()
    gen = torch.Generator().manual_seed(5)
    true = [torch.zeros_like(phi0) for _ in protocols]
    for _ in range(4):
        starts = [flat(p.model) for p in protocols]
        fasts = [s + 0.1 * torch.randn(phi0.numel(), generator=gen) for s in starts]
        for total, start, fast in zip(true, starts, fasts):
            total += start - fast
        assert all(r.complete for r in outer_round(protocols, fasts))
    run_in_threads([p.finish for p in protocols])
    assert all(torch.equal(p.slow, protocols[0].slow) for p in protocols)  # replicas stay identical
    residual = torch.stack([p.residual for p in protocols]).mean(0)
    assert float(residual.norm()) > 0.1 * float(torch.stack(true).mean(0).norm())  # top-k really dropped some
    torch.testing.assert_close(phi0 - protocols[0].slow + residual, torch.stack(true).mean(0), rtol=0, atol=1e-5)


def test_a_codec_that_drops_most_of_a_tensor_needs_a_protocol_with_error_feedback(make_swarm):
    (transport,) = make_swarm(1, codec="topk")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="error feedback"):
        NoLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transport)
    assert DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transport).memory_copies()[-1] == "residual"
