#!/usr/bin/env python3
"""bench/torch_gpu_attention.py: PyTorch's attention on the GPU beside bench_ops's "gpu attention"
lines (shardlab's flash attention in bf16 at the seed's and the 1b Llama's shapes, causal, grouped
query heads, q, k and v split from [B, T, H * D] projections). For each line it times what Hugging
Face's Llama calls on the same shapes, dtype and layout: scaled_dot_product_attention with is_causal
and enable_gqa (PyTorch picks the backend), forward and backward apart, the backward's gradients taken
with respect to the projections as the Llama's are. ratio = PyTorch's ms / ours (above 1: shardlab
faster).

Usage: build/apps/bench_ops --device cuda > OPS.txt
       python3 bench/torch_gpu_attention.py OPS.txt      (- reads standard input)

Prints the GPU, then a line per shape. Exit status 1 when OPS.txt holds no gpu attention line, 3 with
one line "no CUDA GPU: ..." or "no PyTorch: ..." when either is missing.
"""
import re
import statistics
import sys
import time

LINE = re.compile(r"^gpu attention (\S+) bf16 q \[(\d+), (\d+), (\d+), (\d+)\] k/v \[\d+, (\d+), \d+, \d+\] causal: "
                  r"forward ([0-9.]+) ms .*backward ([0-9.]+) ms")


def refuse(reason):
    print(reason)
    sys.exit(3)


def gpu_ms(torch, fn):
    """Median milliseconds per call of fn over 10 samples of about 20 ms each, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(1, min(1000, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(samples)


def pytorch_ms(torch, batch, heads, length, dim, kv_heads):
    """(forward ms, backward ms) of SDPA on projections split into heads, as a Llama splits them."""
    import torch.nn.functional as F

    def projection(count):
        return (torch.rand(batch, length, count * dim, device="cuda", dtype=torch.bfloat16) * 2 - 1).requires_grad_()

    def split(x, count):
        return x.view(batch, length, count, dim).transpose(1, 2)

    q, k, v = projection(heads), projection(kv_heads), projection(kv_heads)

    def forward():
        return F.scaled_dot_product_attention(split(q, heads), split(k, kv_heads), split(v, kv_heads),
                                              is_causal=True, enable_gqa=True)

    out = forward()
    grad = torch.rand_like(out) - 0.5
    with torch.no_grad():
        forward_ms = gpu_ms(torch, forward)
    backward_ms = gpu_ms(torch, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    return forward_ms, backward_ms


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: bench/torch_gpu_attention.py OPS.txt (bench_ops --device cuda's output, - for stdin)")
    text = sys.stdin.read() if argv[1] == "-" else open(argv[1], encoding="utf-8").read()
    found = [m for m in map(LINE.match, text.splitlines()) if m]
    if not found:
        sys.exit(f"bench/torch_gpu_attention.py: no 'gpu attention' line in {argv[1]} (bench_ops --device cuda)")
    try:
        import torch
    except ImportError as error:
        refuse(f"no PyTorch: {error}")
    if not torch.cuda.is_available():
        refuse("no CUDA GPU: torch.cuda.is_available() is false")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; ratio = PyTorch's ms / ours")
    for m in found:
        batch, heads, length, dim, kv_heads = (int(m.group(i)) for i in range(2, 7))
        ours = float(m.group(7)), float(m.group(8))
        theirs = pytorch_ms(torch, batch, heads, length, dim, kv_heads)
        print(f"gpu attention {m.group(1)}: ours forward {ours[0]:.3f} ms, backward {ours[1]:.3f} ms; "
              f"PyTorch scaled_dot_product_attention forward {theirs[0]:.3f} ms ({theirs[0] / ours[0]:.2f}), "
              f"backward {theirs[1]:.3f} ms ({theirs[1] / ours[1]:.2f}), "
              f"both {sum(theirs):.3f} ms ({sum(theirs) / sum(ours):.2f})")


if __name__ == "__main__":
    main(sys.argv)
