#!/usr/bin/env python3
"""bench/pytorch_gpu_cnn.py: the PyTorch peer of `train_cnn --device cuda` on one GPU, for bench/gpu_speed.py.

The PyTorch FSDP tutorial's MNIST net (models/cnn.h, layer for layer, dropout on), in f32 as
train_cnn trains by default, with the tutorial's Adadelta (lr 1.0) and nll_loss summed over the
batch, on one GPU as a plain module: at one rank FSDP would add only its hooks. Each step trains
on a fresh batch of random images (standard normal, [B, 1, 28, 28]) and labels drawn on the GPU
from --seed, instead of Fashion-MNIST: the speed is the same and nothing needs to be read.
--mode compile runs the whole net through torch.compile. After --warmup steps, --steps steps are
timed one by one between torch.cuda.synchronize() calls; prints one JSON line: the median step,
images/s, the peak of torch.cuda.max_memory_allocated over the steps, the last loss.

Without a CUDA GPU it prints one line, "pytorch_gpu_cnn: no CUDA GPU: <why>", and exits 3
(without PyTorch: "pytorch_gpu_cnn: no PyTorch: <why>", exit 3); bad arguments exit 2 first.

    python3 bench/pytorch_gpu_cnn.py --mode eager --steps 50
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speed_math  # noqa: E402

PROGRAM = "pytorch_gpu_cnn"


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog=PROGRAM, description="The PyTorch peer of train_cnn on one GPU.")
    parser.add_argument("--mode", choices=("eager", "compile"), default="eager")
    parser.add_argument("--steps", type=speed_math.positive, default=50, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=speed_math.positive, default=3, help="untimed steps first (compile compiles here)")
    parser.add_argument("--batch", type=speed_math.positive, default=speed_math.CNN_BATCH, help="images per step")
    parser.add_argument("--seed", type=int, default=1, help="seed of the initialisation and the batches")
    # Debugging on a machine without a GPU: the same steps on the CPU.
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# The arguments are checked before PyTorch loads, so that a bad one is refused (exit 2) on any machine.
if __name__ == "__main__":
    ARGUMENTS = parse_arguments(sys.argv[1:])

try:
    import torch
    import torch.nn.functional as F
except ImportError as missing:
    print(f"{PROGRAM}: no PyTorch: {missing}", flush=True)
    sys.exit(3)

import pytorch_gpu_llama as peer  # noqa: E402  (what both peers share; it needs PyTorch)
from pytorch_train_cnn import Net  # noqa: E402  (the tutorial's net, layer for layer)


def cnn_step(model, optimizer, batch, device, generator):
    """One training step on a fresh random batch; returns its mean loss (on the device)."""
    images = torch.randn(batch, 1, 28, 28, device=device, generator=generator)
    labels = torch.randint(0, 10, (batch,), device=device, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    loss = F.nll_loss(model(images), labels, reduction="sum")
    loss.backward()
    optimizer.step()
    return loss.detach() / batch


def main(args):
    device = peer.require_device(PROGRAM, args.device)
    torch.manual_seed(args.seed)  # the initialisation and the dropout masks
    net = Net().to(device)
    parameters = sum(p.numel() for p in net.parameters())
    model = torch.compile(net) if args.mode == "compile" else net
    optimizer = torch.optim.Adadelta(net.parameters(), lr=1.0)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    peer.reset_peak_memory(device)
    seconds, loss = peer.timed_steps(lambda: cnn_step(model, optimizer, args.batch, device, generator), device,
                                     args.warmup, args.steps)
    print(json.dumps({"side": "pytorch", "config": "cnn", "mode": args.mode, "params": parameters,
                      "images_per_s": args.batch / seconds, "step_ms": 1e3 * seconds,
                      "peak_memory_bytes": peer.peak_memory_bytes(device), "loss": loss.item(),
                      "device_name": peer.device_name(device), "torch": torch.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGUMENTS))
