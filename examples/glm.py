"""A GLM-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP,
causal-LM loss. Configs: `tiny` (tests) and `small` (~17M parameters, benchmarks).

As a glmc FILE: defines `workload(config="tiny")` returning (model, example_inputs, None,
optimizer); the model computes its own loss from (input_ids, labels).
    glmc compile examples/glm.py --steps 20
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GLMConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    dropout: float = 0.0


CONFIGS = {
    "tiny": GLMConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=172, seq=32, batch=4),
    "small": GLMConfig(vocab=8192, dim=384, layers=6, heads=6, kv_heads=2, ffn=1024, seq=128,
                       batch=8),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rotary(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=True)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = self.dropout(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)


class SwiGLU(nn.Module):
    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.dim), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GLM(nn.Module):
    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary(cfg.seq, cfg.dim // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1))


def make_batch(cfg: GLMConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return ids, ids.clone()


def workload(config: str | None = None):
    cfg = CONFIGS[config or os.environ.get("GLM_CONFIG", "tiny")]
    torch.manual_seed(0)
    model = GLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return model, make_batch(cfg), None, optimizer
