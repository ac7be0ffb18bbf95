#!/usr/bin/env python3
"""tests/scripts/speed_math_tests.py: the GPU speed comparison without a GPU.

bench/speed_math.py's arithmetic against figures worked out here by hand (the seed Llama's 179.4M
parameters, the 1b preset as models/llama.cpp defines it, FLOPs per token, MFU of measured
anchors, the peak table, the ratio); bench/gpu_speed.py against stand-ins for the build's apps,
for Python and for nvidia-smi (no GPU: each run skipped; no torch; a run that crashes, hangs, talks
too much or trains another model: failed; every figure in the table; each bad argument refused);
and the PyTorch peers' refusals (bad arguments exit 2, no PyTorch or no CUDA exit 3 in one line)
through a stand-in torch package. Runs in seconds, on any machine.

Usage: speed_math_tests.py <bench/gpu_speed.py>. Prints one line per check, then
"speed_math: N passed, N failed, N skipped".
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(sys.argv[1]))
REPOSITORY = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(REPOSITORY, "tests", "apps"))
import speed_math  # noqa: E402
from jobs import Checks  # noqa: E402

SEED_PARAMETERS = 179_448_576
ONE_B_PARAMETERS = 1_100_048_384
H100 = "NVIDIA H100 80GB HBM3"


# --- the arithmetic ----------------------------------------------------------------------------------

def llama_by_hand(vocab, hidden, layers, heads, kv_heads, intermediate):
    """Per layer: q and o are H x H, k and v H x (kv_heads x head_dim), gate, up and down H x I, two
    norms of H; then the embedding and the untied head V x H each and the final norm."""
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def preset_1b():
    """models/llama.cpp's 1b preset, its fields read from the C++ source, and models/llama.h's
    defaults for the fields it leaves alone."""
    with open(os.path.join(REPOSITORY, "models", "llama.cpp"), encoding="utf-8") as file:
        block = file.read().split('if (name == "1b")', 1)[1].split("}", 1)[0]
    fields = {name: int(value) for name, value in re.findall(r"\.(\w+) = (\d+)", block)}
    with open(os.path.join(REPOSITORY, "models", "llama.h"), encoding="utf-8") as file:
        header = file.read()
    for name in ("rms_norm_eps", "rope_theta"):
        fields[name] = float(re.search(rf"double {name} = ([\d.e+-]+);", header).group(1))
    fields["tie_word_embeddings"] = re.search(r"bool tie_word_embeddings = (\w+);", header).group(1) == "true"
    return fields


def check_arithmetic(check):
    seed = speed_math.llama_config("seed")
    shape = {k: seed[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "intermediate_size", "vocab_size")}
    check("bench/llama_seed.json: hidden 768, 12 layers, 12/3 heads, intermediate 3072, vocab 50000",
          shape == {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 3,
                    "intermediate_size": 3072, "vocab_size": 50000}, str(shape))
    check("bench/llama_seed.json: rope theta 10000, rms eps 1e-5, 2048 positions, untied, a llama of silu",
          (seed["rope_theta"], seed["rms_norm_eps"], seed["max_position_embeddings"], seed["tie_word_embeddings"],
           seed["model_type"], seed["hidden_act"]) == (10000.0, 1e-5, 2048, False, "llama", "silu"), str(seed))
    by_hand = llama_by_hand(50000, 768, 12, 12, 3, 3072)
    check(f"the seed Llama has {SEED_PARAMETERS} parameters (179.4M), by hand and by speed_math",
          by_hand == SEED_PARAMETERS == speed_math.llama_parameters(seed) and f"{by_hand / 1e6:.1f}M" == "179.4M",
          f"by hand {by_hand}, speed_math {speed_math.llama_parameters(seed)}")
    preset = preset_1b()
    check("the 1b config is models/llama.cpp's 1b preset, field for field",
          all(speed_math.ONE_B[name] == value for name, value in preset.items()) and len(preset) == 10,
          f"preset {preset}\nspeed_math {speed_math.ONE_B}")
    check(f"the 1b Llama has {ONE_B_PARAMETERS} parameters",
          llama_by_hand(32000, 2048, 22, 32, 4, 5632) == ONE_B_PARAMETERS
          == speed_math.llama_parameters(speed_math.llama_config("1b")))
    check("a tied head is not counted twice",
          speed_math.llama_parameters(dict(seed, tie_word_embeddings=True)) == SEED_PARAMETERS - 50000 * 768)
    check("FLOPs per token: 6 N + 12 L H T, the seed Llama at T 512 and the 1b at T 2048",
          speed_math.flops_per_token(seed, 512) == 6 * SEED_PARAMETERS + 12 * 12 * 768 * 512 == 1_133_314_560
          and speed_math.flops_per_token(speed_math.ONE_B, 2048) == 6 * ONE_B_PARAMETERS + 12 * 22 * 2048 * 2048)
    peak = speed_math.peak_flops(H100)
    seed_mfu = speed_math.mfu(293730, speed_math.flops_per_token(seed, 512), peak)
    check("the anchor: PyTorch eager, the seed Llama on an H100 at 293,730 tokens/s, is 33.7% MFU",
          speed_math.percent(seed_mfu) == "33.7%" and abs(seed_mfu - 293730 * 1_133_314_560 / 989e12) < 1e-12,
          str(seed_mfu))
    one_b_mfu = speed_math.mfu(52172, speed_math.flops_per_token(speed_math.ONE_B, 2048), peak)
    check("the anchor: the 1b Llama on an H100 at 52,172 tokens/s is 40.7% MFU",
          speed_math.percent(one_b_mfu) == "40.7%", str(one_b_mfu))
    check_peaks(check)
    check("the ratio is shardlab's throughput over PyTorch's; none without both",
          speed_math.ratio(300.0, 200.0) == 1.5 and speed_math.ratio(None, 200.0) is None
          and speed_math.ratio(300.0, None) is None and speed_math.ratio(300.0, 0.0) is None)
    try:
        speed_math.llama_config("7b")
        refused = ""
    except ValueError as error:
        refused = str(error)
    check("an unknown benchmark Llama is refused, naming the known ones", "'7b'" in refused and "seed, 1b" in refused,
          refused)


def check_peaks(check):
    expected = {H100: 989e12, "NVIDIA H100 SXM5 80GB": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
                "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA GH200 480GB": 989e12,
                "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12, "nvidia h100 pcie": 756e12}
    found = {name: speed_math.peak_flops(name) for name in expected}
    check("the dense bf16 peaks by device name (H100 SXM, PCIe, NVL; H200, H200 NVL, GH200; A100)",
          found == expected, str(found))
    unknown = speed_math.peak_flops("NVIDIA GeForce RTX 4090")
    check("an unknown GPU has no peak, and its MFU is '?'",
          unknown is None and speed_math.percent(speed_math.mfu(1000.0, 1e9, unknown)) == "?")


# --- stand-ins -----------------------------------------------------------------------------------------

STAND_IN_APP = """
import json, os, sys, time
program, args = os.path.basename(sys.argv[0]), sys.argv[1:]
behaviour = os.environ["FAKE_SHARDLAB"]
if behaviour == "no-gpu":
    print(f"{program}: dist::init: device cuda was requested but no usable CUDA driver or device (stand-in)")
    sys.exit(1)
if behaviour == "chatty":
    print("a line of its own")
    print(f"{program}: dist::init: device cuda was requested but no usable CUDA driver or device (stand-in)")
    sys.exit(1)
if behaviour == "crash":
    print(f"{program}: step 1 of 20")
    sys.exit(134)
if behaviour == "hang":
    time.sleep(60)
config = args[args.index("--config") + 1] if "--config" in args else "cnn"
parameters = 999 if behaviour == "other-model" else (179448576 if config.endswith(".json") else 1100048384)
speed = {"cnn": "", "1b": ", 52172 tokens/s"}.get(config, ", 293730 tokens/s")
if config != "cnn":
    print(f"{program}: model {config} with {parameters} parameters")
print(f"{program}: median step 2.0 ms{speed} (19 steps, the first excluded)")
if "--explain" in args:
    print(f"{program}: rank 0 step time: measured 2.0 ms, predicted 2.2 ms (+10.0%)")
print(f"{program}: rank 0's kernel time per step (19 steps after the first, 2.00 ms each):")
print("  op                                calls         ms   % step")
print("  matmul                             10.0      1.500    75.0%")
print(f"{program}: rank 0 collectives of the last step: received 0 B, planned 0 B")
with open(args[args.index("--metrics") + 1], "w") as metrics:
    metrics.write(json.dumps({"rank": 0, "step": 20, "loss": 10.8125}) + "\\n")
    metrics.write(json.dumps({"rank": 0, "steps": 20, "train_peak_memory_bytes": 21474836480}) + "\\n")
"""

STAND_IN_PYTHON = """
import json, os, sys
args = sys.argv[1:]
behaviour = os.environ["FAKE_PYTORCH"]
if args[0] == "-c":
    if behaviour == "no-torch":
        print("Traceback (most recent call last):")
        print("ModuleNotFoundError: No module named 'torch'")
        sys.exit(1)
    sys.exit(0)
program = os.path.basename(args[0])[:-3]
if behaviour == "no-gpu":
    print(f"{program}: no CUDA GPU: Found no NVIDIA driver on your system (stand-in)")
    sys.exit(3)
if behaviour == "chatty":
    print("UserWarning: a warning of its own")
    print(f"{program}: no CUDA GPU: Found no NVIDIA driver on your system (stand-in)")
    sys.exit(3)
if behaviour == "crash":
    print("torch.OutOfMemoryError: CUDA out of memory")
    sys.exit(1)
config = args[args.index("--config") + 1] if "--config" in args else "cnn"
figures = {"side": "pytorch", "config": config, "mode": args[args.index("--mode") + 1], "step_ms": 2.5,
           "peak_memory_bytes": 32212254720, "loss": 10.9, "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
if config == "cnn":
    figures.update(params=1199882, images_per_s=25600.0)
else:
    figures.update(params={"seed": 179448576, "1b": 1100048384}[config],
                   tokens_per_s={"seed": 250000.0, "1b": 40000.0}[config])
print(json.dumps(figures))
"""

STAND_IN_NVIDIA_SMI = """
import os, sys
name = os.environ.get("FAKE_GPU_NAME", "")
if not name:
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(9)
print(name)
"""


def write_program(path, text):
    with open(path, "w", encoding="utf-8") as file:
        file.write(f"#!{sys.executable}\n{text}")
    os.chmod(path, 0o755)


class StandIns:
    """A build directory, a Python and an nvidia-smi that behave as told, in a scratch directory."""

    def __init__(self, scratch):
        self.scratch = scratch
        self.build = os.path.join(scratch, "build")
        os.makedirs(os.path.join(self.build, "apps"))
        for program in ("train_llama", "train_cnn"):
            write_program(os.path.join(self.build, "apps", program), STAND_IN_APP)
        self.python = os.path.join(scratch, "python")
        write_program(self.python, STAND_IN_PYTHON)
        self.bin = os.path.join(scratch, "bin")
        os.makedirs(self.bin)
        write_program(os.path.join(self.bin, "nvidia-smi"), STAND_IN_NVIDIA_SMI)
        self.data = os.path.join(scratch, "fashion-mnist")
        os.makedirs(self.data)
        self.runs = 0

    def speed(self, script, shardlab, pytorch, extra=(), gpu_name=""):
        """(exit status, output, OUT, seconds) of gpu_speed.py with the stand-ins, into a new OUT."""
        self.runs += 1
        out = os.path.join(self.scratch, f"out-{self.runs}")
        env = dict(os.environ, FAKE_SHARDLAB=shardlab, FAKE_PYTORCH=pytorch, FAKE_GPU_NAME=gpu_name,
                   PATH=self.bin + os.pathsep + os.environ.get("PATH", ""))
        command = [sys.executable, script, "--build-dir", self.build, "--out", out, "--python", self.python,
                   "--cnn-data", self.data, *extra]
        began = time.monotonic()
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        return done.returncode, done.stdout, out, time.monotonic() - began


def closing(output):
    return output.strip().splitlines()[-1] if output.strip() else ""


def first_line(path):
    with open(path, encoding="utf-8") as file:
        return file.readline().rstrip("\n")


def read(path):
    with open(path, encoding="utf-8") as file:
        return file.read()


# --- bench/gpu_speed.py ----------------------------------------------------------------------------------

def check_no_gpu(check, script, fakes):
    code, out, out_dir, _ = fakes.speed(script, "no-gpu", "no-gpu")
    check("no GPU: every run skipped, exit 0",
          code == 0 and closing(out) == "speed: 0 passed, 0 failed, 9 skipped", out)
    check("no GPU: shardlab's runs skipped with the reason its one line gave",
          out.count("skipped: shardlab ") == 3 and "skipped: shardlab seed (no GPU: no usable CUDA driver or device "
          "(stand-in))" in out, out)
    check("no GPU: PyTorch's runs skipped with their one line",
          out.count("skipped: pytorch ") == 6 and "skipped: pytorch 1b compile (no CUDA GPU: Found no NVIDIA driver "
          "on your system (stand-in))" in out, out)
    bench = os.path.dirname(os.path.abspath(script))
    expected = {
        "shardlab-seed": f"$ {fakes.build}/apps/train_llama --device cuda --config {bench}/llama_seed.json "
                         f"--mixed-precision bf16 --seq 512 --global-batch 64 --steps 20 --random-tokens "
                         f"--metrics {out_dir}/shardlab-seed.jsonl --profile --explain",
        "shardlab-1b": f"$ {fakes.build}/apps/train_llama --device cuda --config 1b --mixed-precision bf16 --seq 2048 "
                       f"--global-batch 4 --steps 20 --random-tokens --metrics {out_dir}/shardlab-1b.jsonl --profile --explain",
        "shardlab-cnn": f"$ {fakes.build}/apps/train_cnn --device cuda --global-batch 64 --steps 20 "
                        f"--data {fakes.data} --metrics {out_dir}/shardlab-cnn.jsonl --profile --explain",
        "pytorch-seed-eager": f"$ {fakes.python} {bench}/pytorch_gpu_llama.py --config seed --mode eager --steps 20",
        "pytorch-1b-compile": f"$ {fakes.python} {bench}/pytorch_gpu_llama.py --config 1b --mode compile --steps 20",
        "pytorch-cnn-compile": f"$ {fakes.python} {bench}/pytorch_gpu_cnn.py --mode compile --steps 20",
    }
    found = {stem: first_line(os.path.join(out_dir, f"{stem}.txt")) for stem in expected}
    check("each run's raw output in OUT/<side>-<config>[-<mode>].txt, after its command line", found == expected,
          "\n".join(f"{stem}:\n  found    {found[stem]}\n  expected {line}" for stem, line in expected.items()))
    report = read(os.path.join(out_dir, "speed.md"))
    check("no GPU: OUT/speed.md has the table with no figures, the runs and the closing line",
          "| seed | eager | - | - | - |" in report and "speed: 0 passed, 0 failed, 9 skipped" in report, report)


def check_no_torch(check, script, fakes):
    code, out, out_dir, _ = fakes.speed(script, "no-gpu", "no-torch", ["--configs", "seed", "--modes", "eager"])
    check("torch not importable: PyTorch's run skipped, naming the Python and the error, nothing run",
          code == 0 and f"skipped: pytorch seed eager (torch is not importable by {fakes.python}: "
          "ModuleNotFoundError: No module named 'torch')" in out
          and not os.path.exists(os.path.join(out_dir, "pytorch-seed-eager.txt"))
          and closing(out) == "speed: 0 passed, 0 failed, 2 skipped", out)


def check_figures(check, script, fakes):
    code, out, out_dir, _ = fakes.speed(script, "ok", "ok", gpu_name=H100)
    check("both sides' figures: every run passes, exit 0", code == 0 and closing(out) == "speed: 9 passed, 0 failed, "
          "0 skipped", out)
    check("an ok line carries the run's figures",
          "ok: shardlab seed: 293730 tok/s, median step 2.0 ms, predicted 2.2 ms (+10.0%), peak 20.0 GiB, "
          "last loss 10.8125" in out
          and "ok: pytorch cnn eager: 25600 img/s, median step 2.5 ms, peak 30.0 GiB" in out, out)
    # MFU by hand: tokens/s x (6 N + 12 L H T) / 989e12; the ratio shardlab / PyTorch.
    seed_row = (f"| seed | eager | 293730 tok/s | 250000 tok/s | {293730 / 250000:.3f} | 33.7% | "
                f"{100 * 250000 * 1_133_314_560 / 989e12:.1f}% | 20.0 GiB | 30.0 GiB |")
    one_b_row = (f"| 1b | compile | 52172 tok/s | 40000 tok/s | {52172 / 40000:.3f} | 40.7% | "
                 f"{100 * 40000 * 7_707_586_560 / 989e12:.1f}% | 20.0 GiB | 30.0 GiB |")
    cnn_row = f"| cnn | eager | 32000 img/s | 25600 img/s | {32000 / 25600:.3f} | - | - | 20.0 GiB | 30.0 GiB |"
    check("the table: throughput, ratio, MFU on the H100 and peak memory of each side, on stdout",
          all(row in out for row in (seed_row, one_b_row, cnn_row)) and H100 in out,
          f"expected\n{seed_row}\n{one_b_row}\n{cnn_row}\n{out}")
    report = read(os.path.join(out_dir, "speed.md"))
    check("OUT/speed.md: the GPU, the table, and shardlab's --profile table of each config below it",
          f"# shardlab and PyTorch on {H100}" in report and seed_row in report
          and report.count("  matmul                             10.0      1.500    75.0%") == 3
          and report.count("rank 0's kernel time per step (19 steps after the first, 2.00 ms each):") == 3
          and "collectives of the last step" not in report, report)
    code, out, _, _ = fakes.speed(script, "ok", "ok", ["--configs", "seed", "--modes", "eager"], gpu_name="Some GPU")
    check("a GPU not in the peak table: MFU '?'", code == 0 and "| 1.175 | ? | ? |" in out, out)


def check_failures(check, script, fakes):
    one = ["--configs", "seed", "--modes", "eager"]
    code, out, _, _ = fakes.speed(script, "crash", "crash", one)
    check("a crash on either side fails, with its exit status and last lines, exit 1",
          code == 1 and "FAILED: shardlab seed: exit 134" in out and "FAILED: pytorch seed eager: exit 1" in out
          and "CUDA out of memory" in out and closing(out) == "speed: 0 passed, 2 failed, 0 skipped", out)
    code, out, _, _ = fakes.speed(script, "chatty", "chatty", one)
    check("a refusal with more than its one line fails on either side",
          code == 1 and closing(out) == "speed: 0 passed, 2 failed, 0 skipped", out)
    code, out, _, _ = fakes.speed(script, "other-model", "ok", one)
    check("shardlab training another model than PyTorch's fails, naming both counts",
          code == 1 and "FAILED: shardlab seed: trained 999 parameters where 179448576 were expected" in out, out)
    code, out, _, seconds = fakes.speed(script, "hang", "no-gpu", one + ["--limit-s", "1"])
    check("a run past --limit-s is killed and fails", code == 1 and "FAILED: shardlab seed: exit None" in out
          and "(killed after 1 s)" in out and seconds < 30, f"{seconds:.1f} s\n{out}")
    fakes_data, fakes.data = fakes.data, os.path.join(fakes.scratch, "no-such-data")
    code, out, _, _ = fakes.speed(script, "ok", "ok", ["--configs", "cnn", "--modes", "eager"])
    fakes.data = fakes_data
    check("train_cnn without its data set: skipped, naming the directory",
          code == 0 and "skipped: shardlab cnn (" + os.path.join(fakes.scratch, "no-such-data") + " is missing" in out,
          out)


def check_refusals(check, script, fakes):
    def refused(extra, words, base=True):
        args = ["--build-dir", fakes.build, "--out", os.path.join(fakes.scratch, "refused")] if base else []
        done = subprocess.run([sys.executable, script, *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=60)
        check(f"gpu_speed.py {' '.join(extra) or '(no arguments)'}: exit 2 saying {words!r}",
              done.returncode == 2 and words in done.stdout
              and not os.path.exists(os.path.join(fakes.scratch, "refused")),
              done.stdout)
    refused(["--configs", "seed,7b"], "'7b' is not one of seed, 1b, cnn")
    refused(["--modes", "eager,eager"], "'eager,eager' names one twice")
    refused(["--modes", ""], "'' is not one of eager, compile")
    refused(["--steps", "1"], "argument --steps: 1 is less than 2")
    refused(["--limit-s", "soon"], "argument --limit-s: invalid integer value: 'soon'")
    refused([], "the following arguments are required: --build-dir, --out", base=False)
    empty = os.path.join(fakes.scratch, "empty-build")
    os.makedirs(empty)
    refused(["--build-dir", empty, "--configs", "cnn"], f"no program {empty}/apps/train_cnn")
    a_file = os.path.join(fakes.scratch, "a-file")
    open(a_file, "w").close()
    refused(["--out", a_file], f"--out {a_file} is not a directory")


# --- the PyTorch peers ---------------------------------------------------------------------------------------

STAND_IN_TORCH = {
    "__init__.py": "__version__ = '0+stand-in'\nfrom . import cuda, distributed, nn, version\n",
    "cuda.py": ("def is_available():\n    return False\n\n\ndef init():\n"
                "    raise RuntimeError('Found no NVIDIA driver on your system. (stand-in)')\n"),
    "nn/__init__.py": "from . import functional\n\n\nclass Module:\n    pass\n",
    "nn/functional.py": "",
    "distributed/__init__.py": "",
    "distributed/fsdp/__init__.py": "MixedPrecisionPolicy = fully_shard = None\n",
}


def stand_in_torch(directory, cuda_version):
    """A package named torch that imports as the peers import it and has no CUDA GPU; with
    `cuda_version` None it is a build without CUDA. None of it runs anything."""
    for name, text in dict(STAND_IN_TORCH, **{"version.py": f"cuda = {cuda_version!r}\n"}).items():
        path = os.path.join(directory, "torch", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
    return directory


def peer(script, args, python_path=None):
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path
    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.returncode, done.stdout


def check_peers(check, scratch):
    for script, bad, words in (("pytorch_gpu_llama.py", ["--config", "7b"], "argument --config: invalid choice: '7b'"),
                               ("pytorch_gpu_llama.py", ["--steps", "0"], "argument --steps: 0 is not a positive"),
                               ("pytorch_gpu_llama.py", ["--batch", "-4"], "argument --batch: -4 is not a positive"),
                               ("pytorch_gpu_llama.py", ["--seq", "4096"], "--seq 4096 exceeds the seed Llama's 2048"),
                               ("pytorch_gpu_cnn.py", ["--mode", "jit"], "argument --mode: invalid choice: 'jit'"),
                               ("pytorch_gpu_cnn.py", ["--warmup", "0"], "argument --warmup: 0 is not a positive")):
        # A stand-in torch without CUDA: were the arguments read after it, the refusal would be exit 3.
        code, out = peer(script, bad, stand_in_torch(os.path.join(scratch, "torch-none"), None))
        check(f"{script} {' '.join(bad)}: exit 2 with argparse's message, before PyTorch",
              code == 2 and words in out, out)
    missing = os.path.join(scratch, "no-torch")
    os.makedirs(os.path.join(missing, "torch"))
    with open(os.path.join(missing, "torch", "__init__.py"), "w", encoding="utf-8") as file:
        file.write("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    without_cuda = stand_in_torch(os.path.join(scratch, "torch-none"), None)
    no_driver = stand_in_torch(os.path.join(scratch, "torch-cuda"), "12.8")
    for script in ("pytorch_gpu_llama.py", "pytorch_gpu_cnn.py"):
        program = script[:-3]
        for path, line in ((missing, f"{program}: no PyTorch: No module named 'torch'"),
                           (without_cuda, f"{program}: no CUDA GPU: PyTorch 0+stand-in is built without CUDA"),
                           (no_driver, f"{program}: no CUDA GPU: Found no NVIDIA driver on your system. (stand-in)")):
            code, out = peer(script, [], path)
            check(f"{script} where it cannot run: exit 3 and the one line '{line}'",
                  code == 3 and out.strip() == line, out)


def main(script):
    check = Checks()
    check_arithmetic(check)
    with tempfile.TemporaryDirectory(prefix="speed-math-tests.") as scratch:
        fakes = StandIns(scratch)
        check_no_gpu(check, script, fakes)
        check_no_torch(check, script, fakes)
        check_figures(check, script, fakes)
        check_failures(check, script, fakes)
        check_refusals(check, script, fakes)
        check_peers(check, scratch)
    return check.summary("speed_math", 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
