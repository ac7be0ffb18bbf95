#!/usr/bin/python3
"""bench/pytorch_profile_cnn.py: where PyTorch's time goes in the CNN step that train_cnn's --profile
splits up: the tutorial net (dropout included), one thread, a batch of 32 (one rank's share of the global
64), Adam, summed nll_loss; torch.profiler's table of ops by their own time, per step. Needs Debian's
python3-torch, installed by hand; not a dependency of the project or its tests.

    /usr/bin/python3 bench/pytorch_profile_cnn.py --steps 20
"""
import argparse
import os
import sys

# One thread means OpenBLAS's too (torch.set_num_threads does not reach it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_train_cnn import Net  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))

    def step():
        optimizer.zero_grad()
        F.nll_loss(net(x), y, reduction="sum").backward()
        optimizer.step()

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / 1000 / args.steps
    print(f"pytorch {torch.__version__}, 1 thread, batch {args.batch}, Adam: {total:.2f} ms per step "
          f"({args.steps} steps), ops by their own time:")
    print(f"  {'op':<44} {'calls':>6} {'ms':>9} {'% step':>7}")
    for e in rows[:20]:
        ms = e.self_cpu_time_total / 1000 / args.steps
        print(f"  {e.key:<44} {e.count / args.steps:6.1f} {ms:9.3f} {100 * ms / total:6.1f}%")


if __name__ == "__main__":
    main()
