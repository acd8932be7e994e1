#!/usr/bin/env python3
"""The same training step as bench_train_throughput, in PyTorch (eager), for a side-by-side ratio.

Chapter 03's model written with torch.nn: byte vocabulary (259), no positions, RMSNorm, multi-head
causal attention written out (scores, mask, softmax: what chapter 03 computes), SwiGLU MLP, an
untied LM head, mean cross-entropy; AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on matrices
but the embedding) after clipping the global norm to 1. The sizes, warm-up and medians are
bench_train_throughput's. Needs Debian's python3-torch (benchmarks only; never the build or tests).

With --bf16 each size is timed again under torch.autocast("cpu", torch.bfloat16) (bf16 products,
fp32 weights and AdamW: chapter 14's --precision bf16 compares with it), as bf16_tokens_per_s.

    python3 benchmarks/torch_train_throughput.py [--steps 20] [--threads 2] [--json] [--bf16]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

SIZES = [  # name, d_model, n_layers, n_heads, d_ff, seq, batch (as in train_throughput.cpp)
    ("d64 L2 seq64 b4", 64, 2, 2, 192, 64, 4),
    ("d128 L4 seq128 b8", 128, 4, 2, 384, 128, 8),
    ("d256 L4 seq256 b8", 256, 4, 4, 704, 256, 8),
    ("d256 L4 seq256 b8 h8", 256, 4, 8, 704, 256, 8),
]
VOCAB = 259


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def attention(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = torch.matmul(q / (d // self.heads) ** 0.5, k.transpose(-2, -1))
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores.masked_fill_(future, float("-inf"))
        out = torch.matmul(torch.softmax(scores, -1), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Model(nn.Module):
    def __init__(self, d, layers, heads, d_ff):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, heads, d_ff) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def measure(size, steps, bf16=False):
    name, d, layers, heads, d_ff, seq, batch = size
    torch.manual_seed(0)
    model = Model(d, layers, heads, d_ff)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95))
    tokens = torch.randint(VOCAB, (batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    step = median(times)
    return {"model": name, "step_s": step, "tokens_per_s": batch * seq / step}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    parser.add_argument("--bf16", action="store_true",
                        help="each size under torch.autocast(bfloat16) too (bf16_tokens_per_s)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for size in SIZES:
        r = measure(size, args.steps)
        if args.bf16:
            r["bf16_tokens_per_s"] = measure(size, args.steps, bf16=True)["tokens_per_s"]
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['model']:22} {r['step_s'] * 1e3:9.2f} ms {r['tokens_per_s']:10.0f} tokens/s",
                  flush=True)


if __name__ == "__main__":
    main()
