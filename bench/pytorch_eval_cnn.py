#!/usr/bin/python3
"""bench/pytorch_eval_cnn.py: loads a train_cnn --save-model file into PyTorch's version of the
tutorial net and evaluates it on the test set, to show the safetensors file is what PyTorch
expects (names, shapes, dtypes, bytes). Reads it with tests/tools/safetensors_torch.py, as the
`safetensors` package is not in Debian; needs python3-torch, installed by hand.

    build/apps/train_cnn --epochs 1 --save-model /tmp/cnn.safetensors
    /usr/bin/python3 bench/pytorch_eval_cnn.py /tmp/cnn.safetensors
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools"))
from pytorch_train_cnn import Net, read_idx  # noqa: E402
from safetensors_torch import load_safetensors  # noqa: E402


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
