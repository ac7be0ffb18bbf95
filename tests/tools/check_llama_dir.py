#!/usr/bin/env python3
"""tests/tools/check_llama_dir.py [--reference-only] DIR [TEXT]: loads a directory train_llama
--save-model wrote (config.json + model.safetensors) into the PyTorch reference of llama_reference.py,
strictly (every name and shape), and prints the loss of TEXT as byte tokens; then loads it with Hugging
Face transformers' LlamaForCausalLM.from_pretrained(DIR) unchanged and checks both give the same
logits. Exits 1 on any mismatch, and when transformers is missing (it could not check) unless
--reference-only skips that half. Needs PyTorch; never run by the build or CI.
"""
import sys

import torch
import torch.nn.functional as F

from llama_reference import load_directory

BOT, EOT, PAD = 256, 257, 258


def main(directory, text, reference_only):
    model = load_directory(directory)
    ids = torch.tensor([[BOT] + list(text.encode()) + [EOT]])
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    print(f"reference: loaded {directory}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"loss of {len(text)} bytes {loss.item():.4f}")
    if reference_only:
        return 0
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        print("check_llama_dir.py: transformers is not installed, so LlamaForCausalLM.from_pretrained was not "
              "checked; run it with a Python that has transformers (scripts/peers), or pass --reference-only",
              file=sys.stderr)
        return 1
    hf = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(x).logits
    # Hugging Face computes the rotary angles in f32, the reference in f64: tiny differences.
    difference = (hf_logits - logits).abs().max().item()
    print(f"transformers: LlamaForCausalLM.from_pretrained({directory}) max |logit difference| {difference:.2e}")
    return 0 if difference < 1e-3 else 1


if __name__ == "__main__":
    arguments = sys.argv[1:]
    reference_only = "--reference-only" in arguments
    if reference_only:
        arguments.remove("--reference-only")
    if len(arguments) not in (1, 2):
        sys.exit("usage: check_llama_dir.py [--reference-only] DIR [TEXT]")
    text = arguments[1] if len(arguments) == 2 else "Q: How many ranks does it take?"
    sys.exit(main(arguments[0], text, reference_only))
