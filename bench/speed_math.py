"""bench/speed_math.py: the arithmetic of the GPU speed comparison, shared by both of its sides.

The benchmark Llamas' shapes, their parameters and training FLOPs per token, the GPUs' dense bf16
peaks, MFU, the ratio of shardlab's throughput to PyTorch's, and the peers' count arguments. Standard
library only.
"""
import argparse
import json
import os

BENCH = os.path.dirname(os.path.abspath(__file__))
SEED_CONFIG = os.path.join(BENCH, "llama_seed.json")

# models/llama.cpp's "1b" preset (TinyLlama's shape), with LlamaConfig's defaults for the fields the
# preset leaves alone.
ONE_B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
         "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}

# What each side trains per step: the sequence length T and the global batch B.
LLAMA_RUNS = {"seed": {"seq": 512, "batch": 64}, "1b": {"seq": 2048, "batch": 4}}
CNN_BATCH = 64

# Dense (not sparse) bf16 tensor-core FLOP/s, from NVIDIA's data sheets, matched in this order
# against the device's name: GH200 before H200 and the NVL parts before their family, since
# each name contains the next one's key.
PEAK_BF16_FLOPS = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100 SXM", 989e12),
    ("H100 80GB HBM3", 989e12),
    ("A100", 312e12),
)


def positive(text):
    """The peers' argparse type of a count: a positive integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def llama_config(name):
    """The Hugging Face config (a dict) of the benchmark Llama `name`: seed or 1b."""
    if name == "seed":
        with open(SEED_CONFIG, encoding="utf-8") as file:
            return json.load(file)
    if name == "1b":
        return dict(ONE_B)
    raise ValueError(f"no benchmark Llama named '{name}' (seed, 1b)")


def llama_parameters(config):
    """Every parameter of the Llama of a Hugging Face config: embeddings, layers, final norm, and
    the output head unless it is tied to the embeddings (models/llama.cpp counts the same)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_dim = config.get("num_key_value_heads", heads) * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim  # q and o, k and v
    layer = attention + 3 * hidden * config["intermediate_size"] + 2 * hidden  # SwiGLU, two norms
    embedding = config["vocab_size"] * hidden
    head = 0 if config.get("tie_word_embeddings", False) else embedding
    return embedding + layers * layer + hidden + head


def flops_per_token(config, seq):
    """Training FLOPs per token: 6 N (forward and backward of every parameter, embeddings
    included) + 12 L H T (the attention scores and their use, causal masking not halved)."""
    return 6 * llama_parameters(config) + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq


def peak_flops(device_name):
    """The dense bf16 peak of the GPU named `device_name`, or None for one not in the table."""
    name = device_name.upper()
    for key, flops in PEAK_BF16_FLOPS:
        if key.upper() in name:
            return flops
    return None


def mfu(tokens_per_s, flops_per_token_, peak):
    """Model FLOPs utilization as a fraction of `peak`; None without a peak."""
    return None if peak is None else tokens_per_s * flops_per_token_ / peak


def percent(fraction):
    """'33.7%', or '?' for an unknown fraction."""
    return "?" if fraction is None else f"{100 * fraction:.1f}%"


def ratio(shardlab, pytorch):
    """shardlab's throughput over PyTorch's; None where either is missing or PyTorch's is 0."""
    return None if shardlab is None or not pytorch else shardlab / pytorch
