#!/usr/bin/env python3
"""tests/apps/cli_tests.py: every option of every app refuses a bad value with one line naming the
program, the option, the value and the rule ("train_cnn: --global-batch: got '0', expected an
integer >= 1"), exits 1 and starts nothing; outputs the run could not write (--save-model,
--checkpoint-dir, --trace, --metrics) are refused before step 1. Each app's --help is read to check
that the table below covers every option it has, so an option added without a case fails here.
Where no GPU answers, --device cuda ends train_cnn, train_llama, generate and bench_ops at once in
exactly one line naming why (skipped where one does).

The apps run as single processes (no mpirun: MPI starts a singleton), since every refusal comes
before any collective matters; tests/apps/train_*_tests.py check the same under mpirun at 2-4 ranks.

Usage: cli_tests.py <train_cnn> <train_llama> <generate> <checkpoint> <bench_ops> <bench_tokenizer>
<bench_trace>. Prints one line per check, then "cli: N passed, N failed, N skipped".
"""
import os
import re
import sys
import tempfile

from jobs import Checks, run_command


def integer(option, value, minimum):
    return [option, value], f"{option}: got '{value}', expected an integer >= {minimum}"


def number(option, value, rule):
    return [option, value], f"{option}: got '{value}', expected a number {rule}"


def training_cases(scratch):
    """The options train_cnn and train_llama share: (args, message after "program: ")."""
    a_file = os.path.join(scratch, "a-file")
    return [
        integer("--global-batch", "0", 1),
        integer("--global-batch", "abc", 1),
        integer("--steps", "1.5", 1),
        number("--lr", "-1", ">= 0"),
        number("--lr", "nan", ">= 0"),
        integer("--seed", "-3", 0),
        integer("--max-skipped-steps", "-1", 0),
        integer("--prefetch", "-1", 0),
        integer("--reshard-after-forward-group", "-2", 0),
        (["--reshard-after-forward-group", "2"],  # one process: a shard group of 1 has no smaller group
         "fully_shard: reshard_after_forward_group 2 must divide the shard group of 1 ranks and be neither 1 nor "
         "all of it"),
        integer("--threads", "-2", 0),
        integer("--checkpoint-every", "-1", 0),
        integer("--keep", "0", 1),
        (["--memory-limit", "2X"],
         "--memory-limit: got '2X', expected a number of bytes (digits with an optional K, M, G or T: 512M, 2G)"),
        (["--memory-limit", "99999999T"],  # past int64
         "--memory-limit: got '99999999T', expected a number of bytes"),
        (["--sharding", "half"], "sharding 'half' is not one of full, grad_op, optimizer, none, hybrid:G"),
        (["--mixed-precision", "fp8"], "--mixed-precision: 'fp8' is not one of none, bf16"),
        (["--trace-steps", "2:3"], "--trace-steps requires --trace"),
        (["--trace", os.path.join(scratch, "t"), "--trace-steps", "3:1", "--steps", "4"],
         "--trace-steps '3:1': expected FIRST:LAST with 1 <= FIRST <= LAST"),
        (["--trace", os.path.join(a_file, "trace"), "--steps", "4"],
         f"trace: cannot create the directory '{a_file}/trace': Not a directory"),
        (["--metrics", os.path.join(a_file, "m.jsonl")],
         f"cannot write metrics to '{a_file}/m.jsonl': Not a directory"),
        (["--checkpoint-dir", a_file], f"--checkpoint-dir '{a_file}': cannot create the directory: Not a directory"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--async-checkpoint"], "--async-checkpoint requires --checkpoint-dir"),
        (["--checkpoint-staging", "1G"], "--checkpoint-staging requires --async-checkpoint"),
        (["--checkpoint-dir", os.path.join(scratch, "c"), "--async-checkpoint", "--checkpoint-staging", "0.5G"],
         "--checkpoint-staging: got '0.5G', expected a number of bytes"),
        (["--checkpoint-dir", os.path.join(scratch, "c"), "--async-checkpoint", "--checkpoint-staging", "0"],
         "AsyncCheckpointer: the staging bound must be positive, got 0 bytes"),
        (["--device", "gpu"], "--device: got 'gpu', expected one of auto, cpu, cuda"),
        (["--bitwise", "--chunk", "0"], "--chunk: got '0', expected an integer >= 1"),
        (["--chunk", "2"], "--chunk requires --bitwise"),
        (["--recalibrate"], "--recalibrate requires --explain"),
        (["--world-size", "4"], "--world-size requires --explain"),
        (["--explain", "--world-size", "0"], "--world-size: got '0', expected an integer >= 1"),
        (["--explain", "--world-size", "4"],
         "--world-size 4: one process measures no collectives; give the link (--link-bandwidth, --link-latency)"),
        (["--explain", "--world-size", "3", "--sharding", "hybrid:2", "--link-bandwidth", "50", "--link-latency", "20"],
         "explain: hybrid shard groups of 2 ranks do not divide a world of 3 ranks"),
        (["--explain", "--world-size", "100", "--global-batch", "64", "--link-bandwidth", "50", "--link-latency", "20"],
         "global batch: 64 is smaller than the 100 ranks (every rank needs a sample per step)"),
        (["--explain", "--world-size", "2", "--memory-limit", "1G"], "--world-size excludes --memory-limit"),
        (["--explain", "--world-size", "2", "--bitwise"], "--world-size excludes --bitwise"),
        (["--peak-tflops", "10"], "--peak-tflops requires --explain"),
        (["--explain", "--peak-tflops", "0"], "--peak-tflops: got '0', expected a number > 0"),
        (["--explain", "--memory-bandwidth", "-5"], "--memory-bandwidth: got '-5', expected a number > 0"),
        (["--explain", "--launch-overhead", "-1"], "--launch-overhead: got '-1', expected a number >= 0"),
        (["--explain", "--link-bandwidth", "0", "--link-latency", "1"], "--link-bandwidth: got '0', expected a number > 0"),
        (["--explain", "--link-bandwidth", "50"], "--link-bandwidth requires --link-latency"),
        (["--explain", "--link-latency", "-1", "--link-bandwidth", "50"], "--link-latency: got '-1', expected a number >= 0"),
        (["--bitwise", "--global-batch", "8", "--chunk", "3"], "global batch: 8 does not cut into chunks of 3"),
        (["--micro-batches", "0"], "--micro-batches: got '0', expected an integer >= 1"),
        (["--micro-batch-sync", "last"], "--micro-batch-sync requires --micro-batches"),
        (["--micro-batches", "2", "--micro-batch-sync", "never"],
         "--micro-batch-sync: got 'never', expected one of every, reduce-scatter, last"),
        (["--micro-batches", "1", "--micro-batch-sync", "last"],
         "--micro-batch-sync last: a step of one micro-batch (--micro-batches 1) reduces once either way"),
        (["--global-batch", "8", "--micro-batches", "9"],
         "--micro-batches 9: rank 0 of 1 holds 8 samples of the global batch of 8, and every micro-batch needs one"),
        (["--micro-batches", "2", "--micro-batch-sync", "reduce-scatter"],
         "--micro-batch-sync reduce-scatter: no unit of this run has replicas (--sharding full on 1 ranks)"),
        (["--bogus"], "The following argument was not expected: --bogus"),
        (["--explain", "x"], "The following argument was not expected: x"),
    ]


def app_cases(scratch):
    """{app: [(args, message after "app: ")]}; the training apps' runs get --steps 1 unless given."""
    a_file = os.path.join(scratch, "a-file")
    cnn = training_cases(scratch) + [
        integer("--test-batch-size", "0", 1),
        integer("--epochs", "-1", 0),
        number("--gamma", "0", "> 0"),
        integer("--limit-train", "-1", 0),
        integer("--limit-test", "x", 0),
        (["--optimizer", "sgd"], "--optimizer: 'sgd' is not one of adadelta, adam"),
        (["--global-batch", "3", "--data", "/nonexistent/mnist"],
         "load_mnist: found neither '/nonexistent/mnist/train-images-idx3-ubyte.gz'"),
        (["--save-model", scratch], f"--save-model '{scratch}' is a directory, not a file"),
        (["--save-model", os.path.join(a_file, "m.safetensors")],
         f"--save-model '{a_file}/m.safetensors': '{a_file}' is not an existing directory"),
        (["--batch-size", "-4"], "--global-batch: got '-4', expected an integer >= 1"),  # the alias's name
    ]
    llama = training_cases(scratch) + [
        integer("--seq", "0", 1),
        integer("--limit-documents", "-1", 0),
        integer("--epochs", "0", 1),
        integer("--warmup-steps", "-1", 0),
        number("--weight-decay", "-0.1", ">= 0"),
        number("--clip", "0", "> 0"),
        integer("--sample", "-1", 0),
        integer("--sample-tokens", "0", 1),
        integer("--tp", "0", 1),
        (["--tp", "2", "--explain", "--world-size", "4"],
         "--world-size: a run with --tp 2 is not predicted at another world size (its collectives inside the "
         "layers are not modelled)"),
        (["--steps", "2", "--epochs", "1"], "--steps excludes --epochs"),
        (["--random-tokens", "--epochs", "1"], "--random-tokens requires --steps"),
        *[(["--random-tokens", option, value], f"{option} excludes --random-tokens")
          for option, value in (("--data", "/usr/share/games/fortunes"), ("--tokenizer", "bytes"),
                                ("--separator", "%%"), ("--limit-documents", "3"), ("--sample", "1"),
                                ("--sample-tokens", "5"), ("--validation-split", "10"),
                                ("--validation-data", "/usr/share/games/fortunes"), ("--eval-every", "2"))],
        (["--random-tokens", "--pack"], "--pack excludes --random-tokens"),
        (["--block-causal"], "--block-causal requires --pack"),
        (["--lr-decay", "step"], "--lr-decay: got 'step', expected one of cosine, linear"),
        number("--decay-ratio", "0", "> 0"),
        (["--decay-ratio", "1.5"],
         "--decay-ratio 1.5: the fraction of the steps after the warm-up that decay is at most 1"),
        number("--min-lr-factor", "-0.1", ">= 0"),
        (["--min-lr-factor", "1"], "--min-lr-factor 1: the decay must end below the peak lr (below 1)"),
        number("--validation-split", "0", "> 0"),
        (["--validation-split", "100"],
         "--validation-split 100: the percent of the documents held out must be above 0 and below 100"),
        (["--validation-data", "/nonexistent/corpus"], "read_documents: '/nonexistent/corpus' does not exist"),
        integer("--eval-every", "0", 1),
        (["--eval-only"], "--eval-only: there is no validation set (--validation-split or --validation-data)"),
        (["--eval-every", "2"], "--eval-every 2: there is no validation set (--validation-split or --validation-data)"),
        (["--config", "huge"], "LlamaConfig: no preset named 'huge' (tiny, small, 1b)"),
        (["--tokenizer", "words"], "make_tokenizer: unknown tokenizer 'words'"),
        (["--data", "/nonexistent/corpus"], "read_documents: '/nonexistent/corpus' does not exist"),
        (["--init-from", "/nonexistent/model"], "'/nonexistent/model' has no config.json"),
        (["--save-model", os.path.join(a_file, "model")],
         f"--save-model '{a_file}/model': cannot create the directory: Not a directory"),
        (["--save-model", os.path.join(scratch, "m"), "--save-model-max-file-size", "2X"],
         "--save-model-max-file-size: got '2X', expected a number of bytes"),
        (["--save-model", os.path.join(scratch, "m"), "--save-model-dtype", "f64"],
         "--save-model-dtype: got 'f64', expected one of f32, bf16, f16"),
        (["--save-model-max-file-size", "2G"], "--save-model-max-file-size requires --save-model"),
        (["--optimizer", "adam"], "--optimizer: got 'adam', expected one of adamw, sgd"),
        number("--momentum", "-0.5", ">= 0"),
        (["--momentum", "0.5"], "--momentum is SGD's: --optimizer adamw has none"),
        (["--save-model-dtype", "bf16"], "--save-model-dtype requires --save-model"),
    ]
    generate = [
        (["/nonexistent/model"], "'/nonexistent/model' has no config.json"),
        ([], "model is required"),
        (["m", "--samples", "0"], "--samples: got '0', expected an integer >= 1"),
        (["m", "--tokens", "0"], "--tokens: got '0', expected an integer >= 1"),
        (["m", "--temperature", "-1"], "--temperature: got '-1', expected a number >= 0"),
        (["m", "--top-k", "-1"], "--top-k: got '-1', expected an integer >= 0"),
        (["m", "--seed", "x"], "--seed: got 'x', expected an integer >= 0"),
        (["m", "--threads", "-1"], "--threads: got '-1', expected an integer >= 0"),
        (["m", "--device", "tpu"], "--device: got 'tpu', expected one of auto, cpu, cuda"),
        (["/nonexistent/model", "--tokenizer", "/nonexistent/tokenizer.json"],
         "BpeTokenizer::load: cannot open '/nonexistent/tokenizer.json'"),
        (["/nonexistent/model", "--logits", os.path.join(a_file, "logits.safetensors")],
         f"--logits '{a_file}/logits.safetensors': '{a_file}' is not an existing directory"),
    ]
    checkpoint = [
        ([], "a subcommand is required: info, consolidate or convert"),
        (["info"], "dir is required"),
        (["info", "/nonexistent"], "checkpoint_info: '/nonexistent': metadata.json is missing"),
        (["consolidate", "/nonexistent"], "out is required"),
        (["frobnicate"], "The following argument was not expected: frobnicate"),
    ]
    benches = {
        "bench_ops": [(["--reps", "0"], "--reps: got '0', expected an integer >= 1"),
                      (["--threads", "-1"], "--threads: got '-1', expected an integer >= 0"),
                      (["--device", "gpu"], "--device: got 'gpu', expected one of auto, cpu, cuda")],
        "bench_tokenizer": [(["--vocab", "0"], "--vocab: got '0', expected an integer >= 1"),
                            (["--passes", "0"], "--passes: got '0', expected an integer >= 1"),
                            (["--corpus", "/nonexistent/corpus"], "read_documents: '/nonexistent/corpus' does not exist"),
                            *[([option, os.path.join(a_file, "out.json")],
                               f"{option} '{a_file}/out.json': '{a_file}' is not an existing directory")
                              for option in ("--save", "--save-documents", "--save-ids")]],
        "bench_trace": [(["--sites", "0"], "--sites: got '0', expected an integer >= 1")],
    }
    return {"train_cnn": cnn, "train_llama": llama, "generate": generate, "checkpoint": checkpoint, **benches}


# Options whose every value is valid (free text), or that have no value, per app.
FREE = {
    "train_cnn": {"--help", "--explain", "--detect-anomaly", "--resume", "--profile", "--share-gpu", "--bitwise"},
    "train_llama": {"--help", "--explain", "--detect-anomaly", "--resume", "--profile", "--share-gpu", "--bitwise",
                    "--separator",
                    "--no-decay-norms",
                    "--activation-checkpointing", "--cpu-offload"},
    "generate": {"--help", "--prompt", "--print-ids"},
    "checkpoint": {"--help"},
    "bench_ops": {"--help"},
    "bench_tokenizer": {"--help", "--tokenizer"},
    "bench_trace": {"--help"},
}


def help_options(program):
    """The long options --help lists."""
    _, output = run_command([program, "--help"])
    return set(re.findall(r"^\s+(?:-\w,)?(--[\w-]+)", output, re.M)) | set(
        re.findall(r",(--[\w-]+)", output))


def main(programs):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="cli_tests.") as scratch:
        with open(os.path.join(scratch, "a-file"), "w", encoding="utf-8") as f:
            f.write("not a directory\n")
        for app, cases in app_cases(scratch).items():
            program = programs[app]
            covered = {arg for args, _ in cases for arg in args if arg.startswith("--")}
            missing = sorted(help_options(program) - covered - FREE[app])
            check(f"{app}: every option of --help has a bad-value case", not missing, f"without one: {missing}")
            for args, message in cases:
                if app.startswith("train_") and "--steps" not in args and "--epochs" not in args:
                    args = args + ["--steps", "1"]
                code, output = run_command([program] + args)
                expected = f"{app}: {message}"
                check(f"{app} {' '.join(args)}: exit 1, '{message}' once",
                      code == 1 and output.count(expected) == 1, f"exit {code}, expected once: {expected}\n{output}")
        skipped = check_cuda_refused(check, programs)
    return check.summary("cli", skipped)


# Where no GPU answers, --device cuda: "<app>: [dist::init: ]device cuda was requested but <why>".
CUDA_REFUSALS = {
    "generate": (["/nonexistent/model"], "generate: dist::init: device cuda was requested but "),
    "train_cnn": (["--steps", "1"], "train_cnn: dist::init: device cuda was requested but "),
    "train_llama": (["--steps", "1"], "train_llama: dist::init: device cuda was requested but "),
    "bench_ops": (["--reps", "1"], "bench_ops: device cuda was requested but "),
}


def check_cuda_refused(check, programs):
    """--device cuda without a GPU ends each app at once in exactly one line naming why; on a machine
    whose GPU answers (generate then goes on to the missing model) the cases are skipped."""
    for app, (args, expected) in CUDA_REFUSALS.items():
        code, output = run_command([programs[app], "--device", "cuda"] + args)
        if app == "generate" and code == 1 and "has no config.json" in output:
            print("cli: a GPU answers here: the --device cuda refusals are skipped")
            return len(CUDA_REFUSALS)
        lines = [line for line in output.splitlines() if line.strip()]
        check(f"{app} --device cuda without a GPU: exit 1 in one line, '{expected}...'",
              code == 1 and len(lines) == 1 and lines[0].startswith(expected), f"exit {code}\n{output}")
    return 0


if __name__ == "__main__":
    names = ["train_cnn", "train_llama", "generate", "checkpoint", "bench_ops", "bench_tokenizer", "bench_trace"]
    if len(sys.argv) != len(names) + 1:
        sys.exit(__doc__)
    sys.exit(main(dict(zip(names, sys.argv[1:]))))
