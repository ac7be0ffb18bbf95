#!/usr/bin/python3
"""bench/pytorch_eval_cnn.py: loads a train_cnn --save-model file into PyTorch's version of the
tutorial net and evaluates it on the test set, to show the safetensors file is what PyTorch
expects (names, shapes, dtypes, bytes). Reads the format with struct + json, as the
`safetensors` package is not in Debian; needs python3-torch, installed by hand.

    build/apps/train_cnn --epochs 1 --save-model /tmp/cnn.safetensors
    /usr/bin/python3 bench/pytorch_eval_cnn.py /tmp/cnn.safetensors
"""
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from pytorch_train_cnn import Net, read_idx  # noqa: E402

DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        raw = bytearray(data[base + start:base + end])
        tensors[name] = torch.frombuffer(raw, dtype=DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors


def main():
    path = sys.argv[1]
    data_dir = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/datasets/fashion-mnist"
    model = Net()
    model.load_state_dict(load_safetensors(path), strict=True)
    model.eval()
    images = read_idx(os.path.join(data_dir, "t10k-images-idx3-ubyte.gz"))
    labels = torch.from_numpy(read_idx(os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz")).astype(np.int64))
    x = ((torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.1307) / 0.3081).unsqueeze(1)
    with torch.no_grad():
        output = model(x)
    loss = F.nll_loss(output, labels, reduction="sum").item() / len(labels)
    correct = (output.argmax(dim=1) == labels).sum().item()
    print(f"pytorch on {path}: Average loss: {loss:.4f}, Accuracy: {correct}/{len(labels)} "
          f"({100.0 * correct / len(labels):.2f}%)")


if __name__ == "__main__":
    main()
