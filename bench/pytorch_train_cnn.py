#!/usr/bin/python3
"""bench/pytorch_train_cnn.py: the PyTorch reference for apps/train_cnn's throughput.

Trains the tutorial net (the PyTorch FSDP tutorial's MNIST model) on the same IDX files with the
same batch size, optimizer (Adadelta lr 1.0) and summed nll_loss, and prints images/s over the
training loop only, the way train_cnn reports it, and the median step time after the first;
--compile runs it through torch.compile. Runs with Debian's python3-torch (1.13) or the peers'
environment (scripts/peers: PyTorch 2.15); neither is a dependency of the project or its tests.

    /usr/bin/python3 bench/pytorch_train_cnn.py --limit-train 6400 --threads 2
"""
import argparse
import gzip
import os
import statistics
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def read_idx(path):
    import numpy as np  # here only: the GPU peer imports Net from this file without numpy

    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    _, _, code, ndim = struct.unpack(">BBBB", data[:4])
    assert code == 0x08, f"{path}: expected unsigned bytes"
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--limit-train", type=int, default=6400)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the net (inductor); its first step, which compiles, is reported apart")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    images = read_idx(os.path.join(args.data, "train-images-idx3-ubyte.gz"))[: args.limit_train]
    labels = read_idx(os.path.join(args.data, "train-labels-idx1-ubyte.gz"))[: args.limit_train]
    x = (torch.from_numpy(images).to(torch.float32) / 255.0 - 0.1307) / 0.3081
    x = x.unsqueeze(1)
    y = torch.from_numpy(labels).to(torch.int64)
    net = Net()
    optimizer = torch.optim.Adadelta(net.parameters(), lr=1.0)
    model = torch.compile(net) if args.compile else net
    model.train()
    order = torch.randperm(len(x))
    start = time.perf_counter()
    seen = 0
    steps = []
    for first in range(0, len(x), args.batch_size):
        idx = order[first:first + args.batch_size]
        step_start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx], reduction="sum")
        loss.backward()
        optimizer.step()
        steps.append(time.perf_counter() - step_start)
        seen += len(idx)
    elapsed = time.perf_counter() - start
    mode = " compiled" if args.compile else ""
    print(f"pytorch {torch.__version__}{mode}: {seen} images in {elapsed:.2f} s = {seen / elapsed:.1f} images/s "
          f"({args.threads} threads, batch {args.batch_size}, last loss {loss.item() / len(idx):.4f})")
    # The first step builds caches (and, compiled, compiles): the median of the others is the speed.
    print(f"first step {steps[0]:.2f} s; median step {1000 * statistics.median(steps[1:]):.2f} ms "
          f"({len(steps) - 1} steps, the first excluded)")


if __name__ == "__main__":
    main()
