"""A small GPT split into embedding, transformer blocks and head, so it can later be cut into pipeline stages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Model shape. `context` is the longest sequence the model accepts."""

    vocab_size: int = 256
    context: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, d_model): token + learned position embeddings, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.context = config.context
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.context:
            raise ValueError(f"sequence length {length} exceeds the model context {self.context}")
        positions = torch.arange(length, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)  # residual output projection
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> 4 d_model -> GELU -> d_model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)  # residual output projection
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Hidden states (B, T, d_model) -> logits (B, T, vocab_size): final LayerNorm + bias-free Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, vocab) against targets (B, T): targets[b, t] is the token after
    position t (the data's y, already shifted)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """Decoder-only transformer: `embed` -> `blocks` -> `head`. Initialisation depends only on torch's RNG state."""

    # no files of its own: a checkpoint keeps its state dict (decentral.models.hf.HFCausalLM writes its own layout)
    write_files = read_files = None

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        scale = 1.0 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for block in self.blocks:
                block.attn.proj.weight.mul_(scale)
                block.mlp.proj.weight.mul_(scale)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean cross-entropy (None without targets).

        Raises ValueError when T > config.context.
        """
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return logits, None if targets is None else next_token_loss(logits, targets)

    def num_parameters(self) -> int:
        """Total number of parameters."""
        return sum(p.numel() for p in self.parameters())
