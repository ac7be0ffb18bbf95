#!/usr/bin/env python3
"""bench/torch_llama_ops.py: adds PyTorch's own ops to bench_ops's "block op" lines. Reads bench_ops's
output on stdin and, for each of the Llama block's fused ops it timed (attention, SwiGLU, RMSNorm at
bench/llama_h256_l4.json's shapes, T256 B16), times what Hugging Face's Llama runs for it on the same
shapes and layouts with bench_ops's thread count: scaled_dot_product_attention with the causal and
padding mask as one boolean mask and the key/value heads shared (enable_gqa), silu(gate) * up, and
LlamaRMSNorm's formula (and torch.nn.functional.rms_norm). Forward and backward apart; ratio =
PyTorch's time / ours (above 1: shardlab faster).

Usage (PyTorch from the peers' environment, scripts/peers):
  build/apps/bench_ops --device cpu | ~/.cache/shardlab-peers/venv/bin/python bench/torch_llama_ops.py
"""
import re
import statistics
import time

import torch
import torch.nn.functional as F

from torch_gemm import bench_lines

BLOCK_OP = re.compile(r"^block op (\w+) .*: forward ([0-9.]+) ms, backward ([0-9.]+) ms")
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP = 16, 256, 8, 2, 32, 256, 1024


def per_call_ms(fn, setup=lambda: None):
    """Median milliseconds of fn(setup()) over calls filling about 0.3 s, after a warm-up."""
    fn(setup())
    times = []
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline or len(times) < 5:
        state = setup()
        start = time.perf_counter()
        fn(state)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def forward_and_backward(make_inputs, op):
    """(forward ms, backward ms) of op on fresh leaves from make_inputs(): the backward timed alone."""
    inputs = make_inputs()
    grad = torch.rand_like(op(*inputs)) - 0.5

    def leaves():
        return [t.detach().requires_grad_() for t in inputs]

    forward = per_call_ms(lambda xs: op(*xs), leaves)
    backward = per_call_ms(lambda out: out.backward(grad), lambda: op(*leaves()))
    return forward, backward


def heads(count):  # [B, T, count * D] split into [B, count, T, D], as a Llama splits its projections
    return (torch.rand(BATCH, LENGTH, count * HEAD_DIM) * 2 - 1).view(BATCH, LENGTH, count, HEAD_DIM).transpose(1, 2)


def attention():
    lengths = torch.tensor([LENGTH if b % 2 == 0 else LENGTH - 48 for b in range(BATCH)])
    keys = torch.arange(LENGTH)
    visible = (keys[None, :] <= keys[:, None])[None, None] & (keys[None, :] < lengths[:, None])[:, None, None, :]

    def op(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

    return forward_and_backward(lambda: [heads(HEADS), heads(KV_HEADS), heads(KV_HEADS)], op)


def swiglu():
    return forward_and_backward(lambda: [torch.rand(BATCH, LENGTH, MLP) * 8 - 4, torch.rand(BATCH, LENGTH, MLP) * 2 - 1],
                                lambda gate, up: F.silu(gate) * up)


def rms_norm_hf(x, weight, eps=1e-5):  # transformers' LlamaRMSNorm.forward
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm(functional):
    op = (lambda x, w: F.rms_norm(x, (HIDDEN,), w, 1e-5)) if functional else rms_norm_hf
    return forward_and_backward(lambda: [torch.rand(BATCH, LENGTH, HIDDEN) * 2 - 1, torch.rand(HIDDEN) + 0.5], op)


def main():
    lines = bench_lines()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = PyTorch's ms / ours")
    peers = {"attention": [("scaled_dot_product_attention", attention)],
             "swiglu": [("silu(gate) * up", swiglu)],
             "rms_norm": [("LlamaRMSNorm", lambda: rms_norm(False)), ("F.rms_norm", lambda: rms_norm(True))]}
    for line in lines:
        found = BLOCK_OP.match(line)
        if not found:
            continue
        print(line)
        ours = float(found.group(2)), float(found.group(3))
        for name, peer in peers[found.group(1)]:
            theirs = peer()
            print(f"  PyTorch {name}: forward {theirs[0]:.3f} ms ({theirs[0] / ours[0]:.2f}), "
                  f"backward {theirs[1]:.3f} ms ({theirs[1] / ours[1]:.2f}), "
                  f"both {sum(theirs):.3f} ms ({sum(theirs) / sum(ours):.2f})")


if __name__ == "__main__":
    main()
