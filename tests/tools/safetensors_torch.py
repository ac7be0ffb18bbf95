"""tests/tools/safetensors_torch.py: safetensors files read into and written from PyTorch tensors
with struct + json, as the `safetensors` package is not in Debian: what the PyTorch peers and
golden-file tools share (tests/tools/llama_reference.py, bench/pytorch_eval_cnn.py).
"""
import json
import struct

import torch

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def save_safetensors(named, path, metadata=None):
    header = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(named):
        t = named[name].detach().contiguous().cpu()
        blob = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = TORCH_DTYPES[entry["dtype"]]
        raw = bytearray(data[base + begin:base + end])
        if dtype == torch.bfloat16:
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16) if raw else torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(entry["shape"]).clone()
    return out
