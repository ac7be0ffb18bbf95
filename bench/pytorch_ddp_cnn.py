#!/usr/bin/python3
"""bench/pytorch_ddp_cnn.py: the PyTorch peers for train_cnn's FSDP step time.

The tutorial net (dropout included, as train_cnn runs it) under DDP, or with --fsdp2 under FSDP2's
fully_shard on each convolution and linear layer and then the root (as the PyTorch FSDP tutorial wraps
it), gloo over 2 local processes with 1 thread each, global batch 64 (32 per rank), Adam, summed
nll_loss. Prints the median step time of the steps after the first, the number train_cnn reports as
"median step"; --compile runs the model through torch.compile. DDP runs with Debian's python3-torch
(1.13) or the peers' environment (scripts/peers: PyTorch 2.15), FSDP2 with the peers' only; neither is
a dependency of the project or its tests.

    /usr/bin/python3 bench/pytorch_ddp_cnn.py --steps 100
    ~/.cache/shardlab-peers/venv/bin/python bench/pytorch_ddp_cnn.py --steps 100 --fsdp2
"""
import argparse
import os
import statistics
import sys
import time

# One thread per rank means OpenBLAS's too (torch.set_num_threads does not reach it): it reads this
# when torch loads it, and its idle threads would spin on the other rank's core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_train_cnn import Net, read_idx  # noqa: E402


def train(rank, args):
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    images = read_idx(os.path.join(args.data, "train-images-idx3-ubyte.gz"))[: args.steps * args.global_batch]
    labels = read_idx(os.path.join(args.data, "train-labels-idx1-ubyte.gz"))[: args.steps * args.global_batch]
    x = ((torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.1307) / 0.3081).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    net = Net()
    if args.no_dropout:
        net.dropout1.p = net.dropout2.p = 0.0
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in (net.conv1, net.conv2, net.fc1, net.fc2):
            fully_shard(layer)
        model = fully_shard(net)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if args.compile:
        model = torch.compile(model)
    per_rank = args.global_batch // args.ranks
    times = []
    for step in range(args.steps):
        rows = slice(step * args.global_batch + rank * per_rank, step * args.global_batch + (rank + 1) * per_rank)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.nll_loss(model(x[rows]), y[rows], reduction="sum")
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        mode = " compiled" if args.compile else ""
        wrapper = "FSDP2 fully_shard" if args.fsdp2 else "DDP"
        print(f"pytorch {torch.__version__} {wrapper} gloo{mode}: {args.ranks} ranks x 1 thread, global batch "
              f"{args.global_batch}, Adam: median step {1000 * statistics.median(times[1:]):.1f} ms "
              f"({args.steps - 1} steps, the first excluded; the first {times[0]:.2f} s)")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-dropout", action="store_true", help="the net without its dropout layers")
    parser.add_argument("--fsdp2", action="store_true",
                        help="FSDP2's fully_shard on each conv and linear layer and the root, not DDP")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument("--port", default="29517", help="the rendezvous port (MASTER_PORT)")
    args = parser.parse_args()
    mp.spawn(train, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
