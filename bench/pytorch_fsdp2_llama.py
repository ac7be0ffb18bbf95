#!/usr/bin/env python3
"""bench/pytorch_fsdp2_llama.py: the PyTorch FSDP2 peer of `mpirun -np 2 train_llama --sharding full`
on the CPU: bench/pytorch_train_llama.py's model (transformers' Llama by default), data, optimizer,
schedule, clipping and loss, over
RANKS processes (gloo, one thread each) with fully_shard on every decoder layer and on the root,
as PyTorch's FSDP2 article shards its Llama. Each rank takes its slice of the global batch; the
loss is the mean over the global batch's non-padding targets (each rank's sum over the global
count, times the ranks: FSDP2 averages the gradients), as train_llama computes it. Prints the
median step time after the first (the first, which builds caches and, compiled, compiles, apart)
and tokens/s of the global batch, as JSON. Needs PyTorch 2.4 or later (the peers' environment,
scripts/peers); not a dependency of the project or its tests.

    ~/.cache/shardlab-peers/venv/bin/python bench/pytorch_fsdp2_llama.py --steps 30
"""
import argparse
import json
import os
import statistics
import sys
import time

# One thread per rank, OpenBLAS's included: its idle threads would spin on the other rank's core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_train_llama import PAD, add_arguments, build  # noqa: E402


def shard(model):
    """FSDP2 as PyTorch's article applies it to its Llama: every decoder layer, then the root."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def train(rank, args):
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    config, model, logits_of, data, optimizer, schedule, order = build(args, shard)
    forward = torch.compile(model) if args.compile else model
    per_rank = args.batch // args.ranks
    times, losses = [], []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        first = ((step - 1) * args.batch) % (len(data) - args.batch)
        rows = data[order[first:first + args.batch]]
        targets = (rows[:, 1:] != PAD).sum().item()
        mine = rows[rank * per_rank:(rank + 1) * per_rank]
        x, y = mine[:, :-1], mine[:, 1:]
        logits = logits_of(forward, x)
        loss_sum = F.cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1), ignore_index=PAD,
                                   reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum * (args.ranks / targets)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        times.append(time.perf_counter() - start)
        losses.append(total.item() / targets)
    if rank == 0:
        median = statistics.median(times[1:])
        print(json.dumps({"summary": "pytorch fsdp2", "torch": torch.__version__, "model": args.model,
                          "compiled": args.compile,
                          "ranks": args.ranks, "first_step_seconds": times[0], "median_step_seconds": median,
                          "tokens_per_second": args.batch * args.seq / median, "losses": losses}), flush=True)
    dist.destroy_process_group()
    # Out before the interpreter's teardown, where a worker running transformers' Llama over gloo
    # sometimes aborts ("terminate called without an active exception") after its work is done.
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    add_arguments(p, steps=30, warmup=10)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--port", default="29527", help="the rendezvous port (MASTER_PORT)")
    args = p.parse_args()
    if args.batch % args.ranks != 0:
        sys.exit(f"--batch {args.batch} does not split evenly over {args.ranks} ranks")
    mp.spawn(train, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
