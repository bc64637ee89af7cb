import math

import pytest
import torch

from decentral.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, context=16, n_layer=2, n_head=2, d_model=32)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and one thread stays fast on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make(seed: int = 0, config: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss_optional():
    model = make()
    idx = random_tokens(3, 10)
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 256)
    assert loss is None
    _, loss = model(idx, random_tokens(3, 10, seed=2))
    assert loss.shape == ()


def test_initial_loss_is_near_uniform():
    model = make()
    _, loss = model(random_tokens(8, 16), random_tokens(8, 16, seed=2))
    assert abs(loss.item() - math.log(256)) < 0.3


def test_causal():
    model = make().eval()
    idx = random_tokens(2, 12)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_init_is_deterministic_and_seed_dependent():
    a, b, c = make(0).state_dict(), make(0).state_dict(), make(1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.tok.weight"], c["embed.tok.weight"])


def test_residual_projections_are_scaled_and_biases_zero():
    model = make(config=GPTConfig(n_layer=8, d_model=64, n_head=4, context=16))
    proj = torch.cat([w.flatten() for b in model.blocks for w in (b.attn.proj.weight, b.mlp.proj.weight)])
    assert abs(proj.std().item() - 0.02 / 4) < 0.001  # 1/sqrt(2 * 8) = 1/4
    assert abs(model.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.002
    assert all(b.mlp.fc.bias.abs().max().item() == 0 for b in model.blocks)
    assert model.head.out.bias is None
    assert model.head.out.weight.data_ptr() != model.embed.tok.weight.data_ptr()


def test_too_long_input_raises():
    with pytest.raises(ValueError, match="context"):
        make()(random_tokens(1, TINY.context + 1))


def test_bad_head_count_raises():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_head=4)
    for bad in ({"n_layer": "x"}, {"n_head": 0}, {"context": 1.5}, {"d_model": True}, {"dropout": 1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            GPTConfig(**bad)


def test_learns_repeated_text():
    model = make()
    data = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8))
    starts = torch.arange(0, len(data) - TINY.context - 1, 13)
    x = torch.stack([data[s : s + TINY.context] for s in starts])
    y = torch.stack([data[s + 1 : s + TINY.context + 1] for s in starts])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    _, first = model(x, y)
    for _ in range(40):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first.item()


def test_stages_compose_to_forward():
    model = make().eval()
    idx = random_tokens(2, 9)
    h = model.embed(idx)
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(model.head(h), model(idx)[0])


def test_num_parameters():
    model = make()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    d, v, t, layers = TINY.d_model, TINY.vocab_size, TINY.context, TINY.n_layer
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert model.num_parameters() == v * d + t * d + layers * per_block + 2 * d + d * v
