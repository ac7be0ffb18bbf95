#!/usr/bin/env python3
"""tests/tools/make_llama_golden.py: writes the golden files tests/models/test_llama.cpp compares
against: tests/models/golden/llama_tiny/ (config.json + model.safetensors, the Hugging Face
directory format shardlab loads; random weights drawn in the reference's parameter order) and
tests/models/golden/llama_tiny_golden.safetensors (the batch, logits, loss and every parameter's
gradient), computed by Hugging Face transformers' own LlamaForCausalLM, loaded from that directory,
in f64 with its eager attention; and tests/models/golden/llama_tiny_packed_golden.safetensors, the same
for documents packed into rows (data::Packing::packed) under a block-causal mask, given to Hugging Face
as a 4-D additive attention mask: a token attends to the earlier tokens of its own document only. Hugging Face's padding mask hides padded keys only, so its logits
at padding queries (which shardlab computes without attending to anything) are not shardlab's: the
test compares logits where the query is a token; the loss and the gradients, which ignore padding
targets, are compared whole. Run with the peers' environment (scripts/peers) by hand; never by the
build or CI: rerun it and commit the output.
"""
import json
import os

import torch
import torch.nn.functional as F
import transformers

from llama_reference import Config, LlamaForCausalLM, save_safetensors

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


def packed_batch():
    """Documents packed as data::PretrainingDataset packs them, [BOT] + bytes + [EOT] each in one stream
    cut into windows of LENGTH + 1 every LENGTH ids: two rows, x and y as above, and each input's
    document within its row (PretrainingDataset::dataset_with_documents: up by one at each [BOT] after
    the row's first position)."""
    stream = []
    for text in (b"shard", b"The fox", b"gather, reduce", b"ok", b"scatter"):
        stream += [BOT] + list(text) + [EOT]
    rows = [stream[i * LENGTH:i * LENGTH + LENGTH + 1] for i in range(2)]
    ids = torch.tensor(rows, dtype=torch.int64)
    x = ids[:, :-1].contiguous()
    starts = (x == BOT) & (torch.arange(LENGTH) > 0)
    return x, ids[:, 1:].contiguous(), torch.cumsum(starts.long(), dim=1)


def block_causal_mask(documents):
    """[B, 1, T, T] additive: 0 where key s <= query t lies in t's document, the dtype's lowest else."""
    causal = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool))
    visible = causal & (documents[:, :, None] == documents[:, None, :])
    hidden = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    return hidden[:, None]


def write_golden(model, golden, name):
    for parameter, p in model.named_parameters():
        golden["grad." + parameter] = p.grad
    save_safetensors(golden, os.path.join(GOLDEN, name),
                     {"format": "pt", "source": "tests/tools/make_llama_golden.py", "torch": torch.__version__,
                      "transformers": transformers.__version__})


def load(directory):
    """Hugging Face's model, loaded from the directory as any user loads one, computing in f64."""
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")


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

    model = load(directory)
    x, y = batch()
    padding = x == PAD
    logits = model(input_ids=x, attention_mask=(~padding).long()).logits
    loss = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), y.reshape(-1), ignore_index=PAD)
    loss.backward()
    golden = {"tokens": x, "targets": y, "padding": padding, "logits": logits.detach(), "loss": loss.detach()}
    write_golden(model, golden, "llama_tiny_golden.safetensors")
    print(f"loss {loss.item():.10f}, logits {list(logits.shape)}, {len(golden) - 5} gradients")

    model = load(directory)
    x, y, documents = packed_batch()
    logits = model(input_ids=x, attention_mask=block_causal_mask(documents)).logits
    loss = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), y.reshape(-1))
    loss.backward()
    write_golden(model, {"tokens": x, "targets": y, "documents": documents, "logits": logits.detach(),
                         "loss": loss.detach()}, "llama_tiny_packed_golden.safetensors")
    print(f"packed: loss {loss.item():.10f}, documents {documents.tolist()}")


if __name__ == "__main__":
    main()
