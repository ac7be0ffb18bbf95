#!/usr/bin/env python3
"""tests/scripts/torch_gpu_attention_tests.py: bench/torch_gpu_attention.py with a stand-in torch package:
a GPU whose attention takes a known time (forward 2 ms, backward 4 ms a call) gives PyTorch's time over
ours per shape of bench_ops' lines (ours 1 and 2 ms: ratios near 2, never their inverse); without a GPU
or without PyTorch it ends with exit 3 and one line saying which; no gpu attention line, and a wrong
argument count, are refused. Needs neither a GPU nor PyTorch.

Usage: torch_gpu_attention_tests.py <bench/torch_gpu_attention.py>. Prints one line per check, then
"torch_gpu_attention: N passed, N failed, N skipped".
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

# bench_ops --device cuda's lines, as apps/bench_ops.cpp's print_gpu_attention writes them.
OPS = """bench_ops: 16 CPU threads; CUDA: available
gpu attention seed bf16 q [64, 12, 512, 64] k/v [64, 3, 512, 64] causal: forward 1.000 ms (98.7 TFLOP/s), backward 2.000 ms (123.4 TFLOP/s)
gpu attention 1b bf16 q [4, 32, 2048, 64] k/v [4, 4, 2048, 64] causal: forward 1.000 ms (98.7 TFLOP/s), backward 2.000 ms (123.4 TFLOP/s)
"""

# A torch with a GPU whose attention sleeps: 2 ms forward, 4 ms for the gradients; FAKE_TORCH=no-gpu
# says it has none, FAKE_TORCH=missing fails to import as an absent package does.
STAND_IN = '''
import contextlib, os, time
if os.environ.get("FAKE_TORCH") == "missing":
    raise ImportError("No module named 'torch'")
__version__ = "0.0-stand-in"
bfloat16 = "bfloat16"
class Tensor:
    def __init__(self, shape): self.shape = tuple(shape)
    def __mul__(self, other): return self
    def __sub__(self, other): return self
    def requires_grad_(self): return self
    def view(self, *shape): return Tensor(shape)
    def transpose(self, a, b):
        s = list(self.shape); s[a], s[b] = s[b], s[a]; return Tensor(s)
def rand(*shape, device=None, dtype=None): return Tensor(shape)
def rand_like(t): return Tensor(t.shape)
no_grad = contextlib.nullcontext
class cuda:
    is_available = staticmethod(lambda: os.environ.get("FAKE_TORCH") != "no-gpu")
    get_device_name = staticmethod(lambda: "Stand-in GPU")
    synchronize = staticmethod(lambda: None)
class autograd:
    @staticmethod
    def grad(out, inputs, grad, retain_graph=False):
        time.sleep(0.004); return tuple(Tensor(x.shape) for x in inputs)
'''
FUNCTIONAL = '''
import time
from torch import Tensor
def scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=False):
    assert is_causal and enable_gqa and q.shape[1] % k.shape[1] == 0
    time.sleep(0.002); return Tensor(q.shape)
'''


def stand_in(scratch):
    package = os.path.join(scratch, "torch")
    os.makedirs(os.path.join(package, "nn"))
    for path, text in ((("__init__.py",), STAND_IN), (("nn", "__init__.py"), ""), (("nn", "functional.py"), FUNCTIONAL)):
        with open(os.path.join(package, *path), "w", encoding="utf-8") as out:
            out.write(text)
    return scratch


def run(script, args, scratch, behaviour, stdin=""):
    env = dict(os.environ, PYTHONPATH=scratch, FAKE_TORCH=behaviour)
    done = subprocess.run([sys.executable, script, *args], env=env, input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    return done.returncode, done.stdout


def main(script):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="torch_gpu_attention_tests.") as scratch:
        path = stand_in(scratch)
        ops = os.path.join(scratch, "ops.txt")
        with open(ops, "w", encoding="utf-8") as out:
            out.write(OPS)
        code, out = run(script, [ops], path, "gpu")
        ratios = re.findall(r"^gpu attention (\S+): ours forward 1\.000 ms, backward 2\.000 ms; PyTorch "
                            r"scaled_dot_product_attention forward [0-9.]+ ms \(([0-9.]+)\), backward [0-9.]+ ms "
                            r"\(([0-9.]+)\), both [0-9.]+ ms \(([0-9.]+)\)$", out, re.M)
        near_two = all(1.8 <= float(r) <= 3.0 for _, *rs in ratios for r in rs)
        check("a line per shape, PyTorch's time over ours forward, backward and both (about 2 each)",
              code == 0 and [r[0] for r in ratios] == ["seed", "1b"] and near_two
              and out.startswith("torch 0.0-stand-in on Stand-in GPU; ratio = PyTorch's ms / ours"), out)
        code, out = run(script, ["-"], path, "gpu", stdin=OPS)
        check("- reads bench_ops' output from standard input", code == 0 and out.count("\ngpu attention ") == 2, out)
        code, out = run(script, [ops], path, "no-gpu")
        check("no GPU: exit 3 and one line saying so",
              code == 3 and out == "no CUDA GPU: torch.cuda.is_available() is false\n", out)
        code, out = run(script, [ops], path, "missing")
        check("no PyTorch: exit 3 and one line saying so",
              code == 3 and out == "no PyTorch: No module named 'torch'\n", out)
        code, out = run(script, ["-"], path, "gpu", stdin="bench_ops: 16 CPU threads; CUDA: available\n")
        check("no gpu attention line: exit 1 naming the input",
              code == 1 and out == "bench/torch_gpu_attention.py: no 'gpu attention' line in - "
                                   "(bench_ops --device cuda)\n", out)
        code, out = run(script, [], path, "gpu")
        check("no argument: exit 1 with the usage", code == 1 and out.startswith("usage: bench/torch_gpu_attention.py"),
              out)
    return check.summary("torch_gpu_attention", 0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torch_gpu_attention_tests.py <bench/torch_gpu_attention.py>")
    sys.exit(main(sys.argv[1]))
