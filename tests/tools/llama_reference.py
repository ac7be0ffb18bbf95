"""tests/tools/llama_reference.py: the FSDP2 article's Llama in plain PyTorch (1.13 and later), module for
module and name for name as Hugging Face's LlamaForCausalLM, with its directories read and written
through safetensors_torch.py. The reference shardlab's models/llama.cpp is checked against
(make_llama_golden.py), the loader of directories train_llama saves (check_llama_dir.py), and the
PyTorch side of the CPU benchmark (bench/pytorch_train_llama.py). Never used by the build or CI.

Masking, as shardlab's: causal, and padding tokens neither attend nor are attended; a query with
nothing to attend to (a padding query) outputs zeros.
"""
import json
import math
import os

import torch
from torch import nn
import torch.nn.functional as F

from safetensors_torch import load_safetensors, save_safetensors  # noqa: F401 (save: for the tools)


class Config:
    def __init__(self, **fields):
        self.vocab_size = fields["vocab_size"]
        self.hidden_size = fields["hidden_size"]
        self.intermediate_size = fields["intermediate_size"]
        self.num_hidden_layers = fields["num_hidden_layers"]
        self.num_attention_heads = fields["num_attention_heads"]
        self.num_key_value_heads = fields.get("num_key_value_heads", self.num_attention_heads)
        self.max_position_embeddings = fields.get("max_position_embeddings", 2048)
        self.rms_norm_eps = fields.get("rms_norm_eps", 1e-6)
        self.rope_theta = fields.get("rope_theta", 10000.0)
        self.tie_word_embeddings = fields.get("tie_word_embeddings", False)
        self.head_dim = self.hidden_size // self.num_attention_heads

    @staticmethod
    def load(directory):
        with open(os.path.join(directory, "config.json")) as f:
            return Config(**json.load(f))

    def to_json(self):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": None, "tie_word_embeddings": self.tie_word_embeddings,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config, positions):
    # f64 angles stored in f32, as shardlab (Hugging Face computes them in f32).
    half = config.head_dim // 2
    inverse = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inverse)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def attention(q, k, v, padding):
    """q [B, H, T, D], k and v [B, Hkv, T, D], padding bool [B, T] (True at padding)."""
    batch, heads, length, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q / math.sqrt(dim)) @ k.transpose(-2, -1)
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if padding is not None:
        real = ~padding
        allowed = allowed & real[:, None, None, :] & real[:, None, :, None]
    # The lowest finite value, not -inf: a fully masked row stays finite and is zeroed after.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1) * allowed.any(dim=-1, keepdim=True)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, padding):
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = attention(q, k, v, padding)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = Mlp(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, padding):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, padding)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        cos, sin = rotary_tables(c, c.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, padding=None):
        t = tokens.shape[1]
        h = self.model.embed_tokens(tokens)
        cos, sin = self.cos[:t].to(h.dtype), self.sin[:t].to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, padding)
        h = self.model.norm(h)
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return h @ head.t()

    def init_weights(self, generator):
        """Hugging Face's: every projection and the embedding N(0, 0.02), norms 1."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)


def load_directory(directory):
    """A LlamaForCausalLM from a saved directory (config.json + model.safetensors), strictly."""
    config = Config.load(directory)
    model = LlamaForCausalLM(config)
    weights = load_safetensors(os.path.join(directory, "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model
