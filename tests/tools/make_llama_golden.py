#!/usr/bin/env python3
"""tests/tools/make_llama_golden.py: writes the golden files tests/models/test_llama.cpp compares
against: tests/models/golden/llama_tiny/ (config.json + model.safetensors, the Hugging Face
directory format shardlab loads) and tests/models/golden/llama_tiny_golden.safetensors (the batch,
logits, loss and every parameter's gradient), computed by the PyTorch reference
(llama_reference.py) in f64 from the f32 weights. Needs PyTorch (Debian's python3-torch, installed
by hand); never run by the build or CI: rerun it by hand and commit the output.
"""
import json
import os

import torch
import torch.nn.functional as F

from llama_reference import Config, LlamaForCausalLM, load_directory, save_safetensors

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "golden")
# models::LlamaConfig::preset("tiny").
TINY = Config(vocab_size=259, hidden_size=40, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
BOT, EOT, PAD = 256, 257, 258  # data::ByteTokenizer's special ids
LENGTH = 16


def batch():
    """Three rows as data::PretrainingDataset makes them: [BOT] + bytes + [EOT], padded to
    LENGTH + 1; x the first LENGTH ids, y the last LENGTH. One row fills the window (clipped), one
    is half padding, one holds no byte at all."""
    texts = [b"The quick brown fox jumps", b"shardlab", b""]
    rows = []
    for text in texts:
        ids = ([BOT] + list(text) + [EOT])[:LENGTH + 1]
        rows.append(ids + [PAD] * (LENGTH + 1 - len(ids)))
    ids = torch.tensor(rows, dtype=torch.int64)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main():
    os.makedirs(os.path.join(GOLDEN, "llama_tiny"), exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Larger than the 0.02 of training so every nonlinearity is exercised; norms around 1.
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    directory = os.path.join(GOLDEN, "llama_tiny")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(TINY.to_json(), f, indent=2)
        f.write("\n")
    save_safetensors({k: v for k, v in model.state_dict().items()}, os.path.join(directory, "model.safetensors"))

    # Reload through the directory loader (what check_llama_dir.py uses), then compute in f64.
    model = load_directory(directory).double()
    x, y = batch()
    padding = x == PAD
    logits = model(x, padding)
    loss = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), y.reshape(-1), ignore_index=PAD)
    loss.backward()
    golden = {"tokens": x, "targets": y, "padding": padding, "logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        golden["grad." + name] = p.grad
    save_safetensors(golden, os.path.join(GOLDEN, "llama_tiny_golden.safetensors"),
                     {"format": "pt", "source": "tests/tools/make_llama_golden.py", "torch": torch.__version__})
    print(f"loss {loss.item():.10f}, logits {list(logits.shape)}, {len(golden) - 5} gradients")


if __name__ == "__main__":
    main()
