#!/usr/bin/env python3
"""bench/pytorch_train_llama.py: the PyTorch peer of train_llama on the CPU: the Llama users run,
Hugging Face transformers' LlamaForCausalLM with SDPA attention (--model hf, the default; the peers'
environment, scripts/peers), or the project's own PyTorch Llama written for golden values
(tests/tools/llama_reference.py, --model reference, which Debian's python3-torch 1.13 also runs), with
the same corpus (fortunes as [BOT] + bytes + [EOT], padded with [PAD] to seq + 1), optimizer (AdamW
0.9/0.99, eps 1e-8, wd 0.1), schedule (LinearLR from 0.1 over the warm-up, then cosine to 0),
clipping at 1.0 and loss (cross-entropy ignoring [PAD]). Prints one JSON line per step (loss,
tokens/s) and a summary line (the median step after the first, and the first's time apart);
--compile runs the model through torch.compile.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools"))
from llama_reference import Config, LlamaForCausalLM  # noqa: E402

BOT, EOT, PAD = 256, 257, 258


def documents(directory, separator="%"):
    docs = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        current = []
        with open(path, "rb") as f:
            for line in f.read().split(b"\n"):
                if line == separator.encode():
                    docs.append(b"\n".join(current))
                    current = []
                else:
                    current.append(line)
        docs.append(b"\n".join(current))
    return [d for d in docs if d.strip()]


def sequences(docs, seq):
    rows = []
    for d in docs:
        ids = ([BOT] + list(d) + [EOT])[:seq + 1]
        rows.append(ids + [PAD] * (seq + 1 - len(ids)))
    return torch.tensor(rows, dtype=torch.int64)


def add_arguments(p, steps, warmup):
    """The model, data, optimizer and schedule flags this peer and bench/pytorch_fsdp2_llama.py share."""
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="the global batch")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    p.add_argument("--model", choices=["hf", "reference"], default="hf",
                   help="hf: transformers' LlamaForCausalLM (SDPA); reference: tests/tools/llama_reference.py")


def hf_model(args):
    """transformers' LlamaForCausalLM with SDPA attention, in its own initialisation, and its logits
    for token rows (padding as an attention mask of the tokens, as users pass it)."""
    from transformers import LlamaConfig, LlamaForCausalLM as HfLlama
    config = LlamaConfig(vocab_size=259, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(512, args.seq),
                         rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = HfLlama(config)
    return config, model, lambda forward, x: forward(input_ids=x, attention_mask=(x != PAD).long()).logits


def reference_model(args):
    """tests/tools/llama_reference.py's Llama, and its logits for token rows."""
    config = Config(vocab_size=259, hidden_size=args.hidden, intermediate_size=args.intermediate,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads, max_position_embeddings=max(512, args.seq),
                    rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    return config, model, lambda forward, x: forward(x, x == PAD)


def build(args, shard=lambda model: None):
    """The config, the model (sharded by `shard` before anything holds its parameters), its logits
    function (forward, token rows), the rows of the corpus, the optimizer, the schedule and the order
    of the rows."""
    config, model, logits_of = hf_model(args) if args.model == "hf" else reference_model(args)
    shard(model)
    data = sequences(documents(args.data), args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, args.warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps - args.warmup)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [args.warmup])
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    return config, model, logits_of, data, optimizer, schedule, order


def main():
    p = argparse.ArgumentParser()
    add_arguments(p, steps=300, warmup=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config, model, logits_of, data, optimizer, schedule, order = build(args)
    forward = torch.compile(model) if args.compile else model
    times = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        first = ((step - 1) * args.batch) % (len(data) - args.batch)
        rows = data[order[first:first + args.batch]]
        x, y = rows[:, :-1], rows[:, 1:]
        logits = logits_of(forward, x)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1), ignore_index=PAD)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        seconds = time.perf_counter() - start
        if step > 1:
            times.append(seconds)
        else:
            first_step = seconds  # builds caches; compiled, compiles
        print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": norm.item(),
                          "tokens_per_second": args.batch * args.seq / seconds}), flush=True)
    times.sort()
    median = times[len(times) // 2]
    print(json.dumps({"summary": "pytorch", "torch": torch.__version__, "model": args.model, "compiled": args.compile,
                      "first_step_seconds": first_step, "median_step_seconds": median,
                      "tokens_per_second": args.batch * args.seq / median}))


if __name__ == "__main__":
    main()
