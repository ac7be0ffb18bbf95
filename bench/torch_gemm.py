#!/usr/bin/env python3
"""bench/torch_gemm.py: adds PyTorch's torch.mm to bench_ops's table. Reads bench_ops's output on
stdin, times torch.mm on every matmul row's shape and layout (a transposed operand as a transposed
view, as bench_ops makes it) with bench_ops's thread count, and prints the table again with two
columns more: torch.mm's GFLOP/s and ours over it (above 1: shardlab faster). Rows that are not a
plain matmul (conv2d) get "-".

Usage (PyTorch from the peers' environment, scripts/peers):
  build/apps/bench_ops --device cpu | ~/.cache/shardlab-peers/venv/bin/python bench/torch_gemm.py
"""
import re
import sys
import time

import torch

MATMUL = re.compile(r"^matmul \[(\d+), (\d+)\](\^T)? x \[(\d+), (\d+)\](\^T)?")
THREADS = re.compile(r"^\S+: (\d+) CPU threads")


def median_seconds(fn, reps=7):
    """Median seconds per call over `reps` samples of about 20 ms each, after a warm-up."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = int(min(max(0.02 / once, 1), 10000))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return sorted(samples)[len(samples) // 2]


def torch_gflops(m, k, n, transpose_a, transpose_b):
    a = torch.rand(k, m).t() if transpose_a else torch.rand(m, k)
    b = torch.rand(n, k).t() if transpose_b else torch.rand(k, n)
    return 2.0 * m * n * k / median_seconds(lambda: torch.mm(a, b)) / 1e9


def bench_lines():
    """A bench program's output from stdin, torch set to the CPU thread count it names."""
    lines = sys.stdin.read().splitlines()
    for line in lines:
        found = THREADS.match(line)
        if found:
            torch.set_num_threads(int(found.group(1)))
    return lines


def main():
    lines = bench_lines()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for line in lines:
        found = MATMUL.match(line)
        if line.startswith("op (f32)"):
            print(f"{line} {'torch.mm GF/s':>14} {'vs torch':>9}")
        elif found:
            m, k, k2, n = (int(found.group(i)) for i in (1, 2, 4, 5))
            if k != k2:
                sys.exit(f"torch_gemm.py: inner sizes differ in {line!r}")
            ours = float(line.split()[-4])  # ours, OpenBLAS, ratio, CUDA
            theirs = torch_gflops(m, k, n, bool(found.group(3)), bool(found.group(6)))
            print(f"{line} {theirs:>14.1f} {ours / theirs:>9.2f}")
        elif line.startswith("conv2d"):
            print(f"{line} {'-':>14} {'-':>9}")
        else:
            print(line)


if __name__ == "__main__":
    main()
