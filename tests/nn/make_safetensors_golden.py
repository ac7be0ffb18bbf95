#!/usr/bin/env python3
"""tests/nn/make_safetensors_golden.py: writes tests/nn/golden/torch_small.safetensors, the
golden file test_safetensors.cpp loads. Tensors come from PyTorch (its dtype conversions and
rounding); the file is written with the `safetensors` package when it is installed, else by hand
with struct + json following the format's specification. Never run by the build or the tests:
rerun it by hand and commit the output.
"""
import json
import math
import os
import struct

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "torch_small.safetensors")

DTYPES = {
    torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}


def tensors():
    return {
        # Exact in f32: k / 8 - 0.5.
        "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.5,
        # A transposed (non-contiguous) tensor: serialised in its logical row-major order.
        "proj.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
        # PyTorch rounds these to bf16 / f16; the C++ test holds the rounded values.
        "norm.weight": torch.tensor([1 / 3, -2.5, 1e-3, 262016.0], dtype=torch.float32).to(torch.bfloat16),
        "head.bias": torch.tensor([0.1, -65504.0, 6e-8, 1.0], dtype=torch.float32).to(torch.float16),
        "double": torch.tensor([math.pi, -1e-300], dtype=torch.float64),
        "step": torch.tensor(123456789012345, dtype=torch.int64),
        "ids": torch.tensor([[-1, 2], [3, -2147483648]], dtype=torch.int32),
        "pixels": torch.tensor([0, 128, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 2, dtype=torch.float32),
    }


def write_by_hand(named, path, metadata):
    # Data in the order the Rust writer uses (larger alignment first, then by name); header keys
    # sorted by name, so the header order differs from the data order, as the format allows.
    order = sorted(named, key=lambda n: (-named[n].element_size(), n))
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name in order:
        t = named[name].contiguous()
        blob = t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    named = tensors()
    metadata = {"format": "pt", "source": "make_safetensors_golden.py"}
    try:
        from safetensors.torch import save_file
    except ImportError:
        write_by_hand(named, OUT, metadata)
    else:
        save_file({k: v.contiguous() for k, v in named.items()}, OUT, metadata=metadata)
    for name, t in named.items():
        print(name, DTYPES[t.dtype], list(t.shape), t.flatten().tolist())


if __name__ == "__main__":
    main()
