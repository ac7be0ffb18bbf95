#!/usr/bin/env python3
"""bench/pytorch_gpu_llama.py: the PyTorch peer of `train_llama --device cuda` on one GPU, for bench/gpu_speed.py.

The same Llama in plain PyTorch (RMSNorm, rotary embedding, grouped-query attention through
scaled_dot_product_attention(is_causal=True), SwiGLU, untied head), sharded as PyTorch's FSDP2
shards it (fully_shard on every decoder layer, then on the root; bf16 parameters, f32 gradient
reductions) in a process group of one rank on the one GPU. AdamW (fused) with train_llama's
defaults (lr 1e-3, betas 0.9/0.99, eps 1e-8, weight decay 0.1) at a constant rate (a schedule
changes no work), gradients clipped to norm 1.0, cross-entropy averaged over the batch on f32
logits (as torchtitan computes it). Each step trains on uniform random token ids drawn on the GPU
from --seed: T + 1 per row, the first T the inputs, the last T the targets.

--mode compile runs each decoder layer through torch.compile(fullgraph=True) before sharding, as
torchtitan does (the embedding, head and loss stay eager). --config seed is bench/llama_seed.json
(T 512, B 64), 1b is train_llama's 1b preset (T 2048, B 4). After --warmup steps, --steps steps
are timed one by one between torch.cuda.synchronize() calls; prints one JSON line: the median
step, tokens/s, MFU (a fraction of the GPU's dense bf16 peak, bench/speed_math.py; null for a GPU
it does not know), the peak of torch.cuda.max_memory_allocated over the steps, the last loss.

Without a CUDA GPU it prints one line, "pytorch_gpu_llama: no CUDA GPU: <why>", and exits 3
(without PyTorch: "pytorch_gpu_llama: no PyTorch: <why>", exit 3); bad arguments exit 2 first.

    python3 bench/pytorch_gpu_llama.py --config seed --mode eager --steps 20
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speed_math  # noqa: E402

PROGRAM = "pytorch_gpu_llama"
# train_llama's defaults (apps/train_llama.cpp).
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.99), 1e-8, 0.1, 1.0


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog=PROGRAM, description="The PyTorch FSDP2 peer of train_llama on one GPU.")
    parser.add_argument("--config", choices=sorted(speed_math.LLAMA_RUNS), default="seed")
    parser.add_argument("--mode", choices=("eager", "compile"), default="eager")
    parser.add_argument("--steps", type=speed_math.positive, default=20, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=speed_math.positive, default=3, help="untimed steps first (compile compiles here)")
    parser.add_argument("--seq", type=speed_math.positive, help="tokens per sequence (default: the config's, 512 or 2048)")
    parser.add_argument("--batch", type=speed_math.positive, help="sequences per step (default: the config's, 64 or 4)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the initialisation and the token ids")
    # Debugging on a machine without a GPU: the same steps on the CPU (gloo; slow, so with a small --batch and --seq).
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    run = speed_math.LLAMA_RUNS[args.config]
    args.seq = args.seq or run["seq"]
    args.batch = args.batch or run["batch"]
    positions = speed_math.llama_config(args.config)["max_position_embeddings"]
    if args.seq > positions:
        parser.error(f"--seq {args.seq} exceeds the {args.config} Llama's {positions} positions")
    return args


def cannot_run(program, what, reason):
    """The one line that says why nothing can be measured here, and exit status 3."""
    print(f"{program}: {what}: {reason}", flush=True)
    sys.exit(3)


# The arguments are checked before PyTorch loads, so that a bad one is refused (exit 2) on any machine.
if __name__ == "__main__":
    ARGUMENTS = parse_arguments(sys.argv[1:])

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError as missing:
    cannot_run(PROGRAM, "no PyTorch", missing)


# --- the model -------------------------------------------------------------------------------------

def rotary_tables(config, device):
    """cos and sin of the rotary angles, [positions, head_dim] in f32 (rotate-half layout)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    inverse = 1.0 / (config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
                                              / head_dim))
    angles = torch.outer(torch.arange(config["max_position_embeddings"], dtype=torch.float64, device=device),
                         inverse)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = hidden // self.heads
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Each key/value head serves heads / kv_heads query heads; repeated, as torchtitan does, so that
        # the flash kernel takes them.
        groups = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, groups, t, self.head_dim).reshape(b, self.heads, t, -1)
        v = v[:, :, None].expand(b, self.kv_heads, groups, t, self.head_dim).reshape(b, self.heads, t, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, intermediate = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)
        self.input_layernorm = nn.RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Hugging Face's LlamaForCausalLM without the wrapper: token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, config, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = nn.RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        cos, sin = rotary_tables(config, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        t = tokens.shape[1]
        cos, sin = self.cos[:t].to(h.dtype), self.sin[:t].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def initialize(model, generator):
    """Hugging Face's initialisation: every weight N(0, 0.02), the norms 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


# --- what both peers share ---------------------------------------------------------------------------

def require_device(program, device):
    """`device` as a torch.device (the first GPU for "cuda": torch.cuda.set_device needs its index);
    for CUDA, exits with the one line when no GPU answers."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        cannot_run(program, "no CUDA GPU", why_no_cuda())
    return torch.device("cuda", 0)


def why_no_cuda():
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} is built without CUDA"
    try:
        torch.cuda.init()
    except Exception as error:  # whatever stops CUDA from starting is the reason to give
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return "torch.cuda.is_available() is False"


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, device, warmup, steps):
    """(median seconds of the timed steps, the last step's return value): `warmup` untimed steps,
    then `steps` steps each timed alone, the device idle before and after."""
    for _ in range(warmup):
        result = step()
    times = []
    for _ in range(steps):
        synchronize(device)
        began = time.perf_counter()
        result = step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device):
    """The most bytes PyTorch's allocator held since reset_peak_memory (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# --- the run -------------------------------------------------------------------------------------------

def one_rank_group(device):
    """A process group of this process alone: NCCL on the GPU, gloo on the CPU."""
    with socket.socket() as probe:  # a free port: two runs on one machine do not meet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def sharded_llama(config, mode, device, seed):
    """The Llama on `device`, initialised from `seed`, each layer compiled (in compile mode), then
    sharded by FSDP2; and its parameter count."""
    with device:
        model = Llama(config, device)
    initialize(model, torch.Generator(device=device).manual_seed(seed))
    parameters = sum(p.numel() for p in model.parameters())
    if mode == "compile":
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer, fullgraph=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, parameters


def llama_step(model, optimizer, vocab, shape, device, generator):
    """One training step on fresh random token ids; returns its loss (on the device)."""
    ids = torch.randint(0, vocab, (shape[0], shape[1] + 1), device=device, generator=generator)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def main(args):
    device = require_device(PROGRAM, args.device)
    config = speed_math.llama_config(args.config)
    one_rank_group(device)
    model, parameters = sharded_llama(config, args.mode, device, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    reset_peak_memory(device)
    seconds, loss = timed_steps(
        lambda: llama_step(model, optimizer, config["vocab_size"], (args.batch, args.seq), device, generator),
        device, args.warmup, args.steps)
    tokens_per_s = args.batch * args.seq / seconds
    name = device_name(device)
    fraction = speed_math.mfu(tokens_per_s, speed_math.flops_per_token(config, args.seq), speed_math.peak_flops(name))
    print(json.dumps({"side": "pytorch", "config": args.config, "mode": args.mode, "params": parameters,
                      "tokens_per_s": tokens_per_s, "step_ms": 1e3 * seconds, "mfu": fraction,
                      "peak_memory_bytes": peak_memory_bytes(device), "loss": loss.item(), "device_name": name,
                      "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGUMENTS))
