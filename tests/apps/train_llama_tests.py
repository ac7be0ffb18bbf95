#!/usr/bin/env python3
"""tests/apps/train_llama_tests.py: runs apps/train_llama under mpirun on Debian's fortunes and
checks what its users rely on:

- exact parity: 10 steps of the tiny config (uneven shards at 3 ranks) give every step's loss
  within 1e-5 of the 1-process run at 1, 2, 3 and 4 ranks for full, grad_op, optimizer, none and hybrid, and a
  global batch of 10 split unevenly over 3 and 4 ranks gives its 1-process run's losses;
- prefetching 2 units and CPU offload change nothing; bf16 mixed precision follows the f32 curve;
- activation checkpointing gives the same losses and gradient norms as without, bit for bit;
- --init-from reads each rank's shards from the files: at np 1-4 and with --tp 2 every rank's allocator
  peak and largest allocation equal the random init's, its peak resident memory within a quarter of one
  whole copy of a 50 MB model;
- memory: the persistent model state measured on every rank equals the plan, the gathered
  parameters never exceed the planned peak, those held from forward to backward equal the plan's
  (after forward resharded to pairs of ranks too), and the last step received the planned bytes;
- --save-model writes a directory that apps/generate samples from (with the ids) and scores (--logits:
  the loss it prints is the one recomputed from the logits it writes) and --init-from loads;
- sharded checkpoints every N steps (--keep K) and --resume: bit-exact (losses, parameters, Adam
  state) at the same world size, within 1e-5 at another one;
- --tokenizer bpe:VOCAB: rank 0 learns the tokenizer and every rank uses it (np 2 saves the
  tokenizer.json np 1 saves, with the same losses), --save-model holds it and generate and
  --init-from use it, and --resume refuses another tokenizer;
- --profile prints where a step goes (kernel time per op) and changes no loss;
- tensor parallelism (--tp): 2 ranks as one tp group, 4 as 2 x 2 (also with activation
  checkpointing, and with the uneven global batch) give every step's loss and gradient norm within
  1e-5 of the 1-process run's; a checkpoint saved at 2 x 2 resumes there bit for bit (losses, and
  the step-10 rank files), and at 1 x 2, 4 x 1 and 2 x 1 within 1e-5;
- bad options, a missing corpus and a config that does not fit exit 1 with one clear message;
- --random-tokens reads no corpus, starts near ln(vocab) and gives one process's losses at np 2;
- will it fit: the training peak --explain predicts (above the loaded data) is within 10% of the
  measured one on every rank at np 1-4 for every strategy, with and without activation
  checkpointing; its dry forward/backwards change nothing (losses and saved model bit for bit);
  --memory-limit at the peak trains, one byte under is refused before step 1 with one message.

Usage: train_llama_tests.py <mpirun> <train_llama> <generate>. Without /usr/share/games/fortunes
(scripts/setup installs it) the cases that train are skipped. Prints one line per check, then
"train_llama_app: N passed, N failed, N skipped".
"""
import filecmp
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile

from golden import check_golden
from trace_checks import check_trace_run
from jobs import Checks, check_dry_runs_change_nothing, check_memory_limit, check_peak, read_metrics, run_command, run_job

DATA_DIR = "/usr/share/games/fortunes"
STEPS = 10
BASE_ARGS = ["--config", "tiny", "--seq", "48", "--global-batch", "12", "--limit-documents", "240",
             "--steps", str(STEPS), "--lr", "3e-3", "--threads", "1"]
# A global batch of 10 splits unevenly over 3 (4/3/3) and 4 ranks (3/3/2/2); its own 1-process run
# is their reference.
UNEVEN = ("--global-batch", "10")
RESHARD_TO_PAIRS = ("--reshard-after-forward-group", "2")
OFFLOADED = ("--prefetch", "2", "--cpu-offload")
UNEVEN_RUNS = [(1, "full", UNEVEN), (3, "full", UNEVEN), (4, "full", UNEVEN)]
# (ranks, sharding, extra flags); (1, "full") is the reference. Prefetching more and offloading
# (a no-op on the CPU) change when things happen, never the numbers.
PARITY_RUNS = [(1, "full", ()), (1, "grad_op", ()), (2, "full", ()), (2, "grad_op", ()), (2, "none", ()),
               (2, "hybrid:1", ()), (2, "full", OFFLOADED), (3, "full", ()),
               (3, "grad_op", ()), (3, "none", ()), (4, "full", ()), (4, "grad_op", ()), (4, "none", ()),
               (4, "hybrid:2", ()), (1, "optimizer", ()), (2, "optimizer", ()), (4, "optimizer", ()),
               (4, "full", RESHARD_TO_PAIRS), *UNEVEN_RUNS]
RTOL = 1e-5
# The parity runs whose every step's loss and gradient norm are held to the bit by a golden file.
GOLDEN_RUNS = [(1, "full", ()), (2, "full", ()), (3, "full", ()), (2, "grad_op", ()), (2, "none", ()),
               (2, "hybrid:1", ()), (4, "hybrid:2", ()), (2, "optimizer", ()), (3, "full", UNEVEN)]


def per_step(records, rank, field):
    return {r["step"]: r[field] for r in records if r.get("rank") == rank and "step" in r and field in r}


def close(actual, expected):
    return abs(actual - expected) <= RTOL * abs(expected)  # NaN compares false: it fails


def main(mpirun, train_llama, generate):
    check = Checks()

    check_errors(mpirun, train_llama, check)
    with tempfile.TemporaryDirectory(prefix="train_llama_tests.") as scratch:
        check_random_tokens(mpirun, train_llama, scratch, check)
        check_sgd(mpirun, train_llama, scratch, check)
        check_init_from_memory(mpirun, train_llama, scratch, check)
    skipped = 0
    if not os.path.isdir(DATA_DIR):
        skipped = len(PARITY_RUNS) + len(GOLDEN_RUNS) + 1 + 2 + 14 + 5 + len(FIT_RUNS) + 1 + 4 + TRACE_CHECKS + 1 + 2 * len(TP_RUNS) - 1 + len(TP_RESUMES) + 4 + 5
        print(f"skipped: {skipped} cases that train, {DATA_DIR} is missing (scripts/setup installs fortunes)")
    else:
        with tempfile.TemporaryDirectory(prefix="train_llama_tests.") as scratch:
            check_parity_and_memory(mpirun, train_llama, scratch, check)
            check_tensor_parallel(mpirun, train_llama, scratch, check)
            check_mixed_precision(mpirun, train_llama, scratch, check)
            check_checkpointing(mpirun, train_llama, scratch, check)
            check_resume(mpirun, train_llama, scratch, check)
            check_save_and_generate(mpirun, train_llama, generate, scratch, check)
            check_bpe(mpirun, train_llama, generate, scratch, check)
            check_will_it_fit(mpirun, train_llama, scratch, check)
            check_traces(mpirun, train_llama, scratch, check)
            check_profile(mpirun, train_llama, scratch, check)

    return check.summary("train_llama_app", skipped)


def check_errors(mpirun, program, check):
    cases = [
        (4, ["--global-batch", "3"], "train_llama: global batch: 3 is smaller than the 4 ranks"),
        (2, ["--config", "huge"], "train_llama: LlamaConfig: no preset named 'huge' (tiny, small, 1b)"),
        (2, ["--tokenizer", "words"], "train_llama: "),
        (2, ["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
        (1, ["--seq", "600"], "train_llama: --seq 600 exceeds the model's 512 positions"),
        (2, ["--sharding", "half"], "train_llama: sharding 'half' is not one of full, grad_op, optimizer, none, hybrid:G"),
        (1, ["--config", "/nonexistent/llama.json"], "train_llama: cannot read the config file '/nonexistent/llama.json'"),
        (2, ["--init-from", "/nonexistent/model"], "train_llama: '/nonexistent/model' has no config.json"),
        (1, ["--init-from", "/nonexistent/model", "--config", "small"], "--config excludes --init-from"),
        (2, ["--resume"], "train_llama: --resume needs --checkpoint-dir"),
        (2, ["--tokenizer", "bpe:x"], "train_llama: --tokenizer 'bpe:x': expected bpe:VOCAB with VOCAB a positive integer"),
        (2, ["--tokenizer", "words"], "train_llama: make_tokenizer: unknown tokenizer 'words'"),
        (4, ["--tp", "3"], "train_llama: --tp 3 does not divide the 4 ranks"),
        (4, ["--tp", "4"], "train_llama: tensor parallel over 4 ranks: each rank holds whole heads, but the Llama's 4 "
                           "attention heads (num_attention_heads) and 2 key/value heads (num_key_value_heads) do not "
                           "both divide by tp 4"),
        (2, ["--tp", "2", "--sharding", "grad_op"],
         "train_llama: --tp shards fully across the tensor-parallel groups; --sharding grad_op is not supported with it"),
        (2, ["--tp", "2", "--sample", "1"], "train_llama: --sample is not supported with --tp 2"),
        (2, ["--tp", "2", "--cpu-offload"], "train_llama: --cpu-offload is not supported with --tp 2"),
    ]
    for ranks, args, message in cases:
        code, output = run_job(mpirun, program, ranks, args + ["--steps", "1"])
        check(f"np {ranks} {' '.join(args)} fails, explained once", code not in (0, None) and output.count(message) == 1,
              f"exit {code}, expected once: {message}\n{output}")


def check_parity_and_memory(mpirun, program, scratch, check):
    runs = {}
    for ranks, sharding, extra in PARITY_RUNS:
        metrics = os.path.join(scratch, f"np{ranks}_{sharding.replace(':', '_')}{''.join(extra)}.jsonl")
        code, output = run_job(mpirun, program, ranks,
                               BASE_ARGS + ["--sharding", sharding, "--metrics", metrics] + list(extra))
        runs[(ranks, sharding, extra)] = (code, output, read_metrics(metrics))

    references = {}
    for batch in ((), UNEVEN):
        ref_code, ref_output, ref_records = runs[(1, "full", batch)]
        references[batch] = per_step(ref_records, 0, "loss")
        expected = references[batch]
        falling = ref_code == 0 and len(expected) == STEPS and expected[STEPS] < expected[1] - 0.5
        check(f"the 1-process reference run {' '.join(batch)}: {STEPS} steps, the loss falls", falling,
              f"exit {ref_code}, losses {expected}\n{ref_output}")
    for (ranks, sharding, extra), (code, output, records) in runs.items():
        batch = UNEVEN if extra == UNEVEN else ()
        if (ranks, sharding, extra) == (1, "full", batch):
            continue
        expected = references[batch]
        losses = per_step(records, 0, "loss")
        wrong = [f"step {s}: {losses.get(s)} vs {expected[s]}" for s in expected
                 if s not in losses or not close(losses[s], expected[s])]
        flags = " ".join(("--sharding", sharding) + extra)
        check(f"np {ranks} {flags}: {STEPS} step losses equal the 1-process run's within {RTOL:g}",
              code == 0 and expected and not wrong, f"exit {code}; " + "; ".join(wrong[:4]) + "\n" + output)

    for ranks, sharding, extra in GOLDEN_RUNS:
        check_golden(check, "train_llama_steps.json", " ".join([f"train_llama np {ranks} --sharding {sharding}", *extra]),
                     runs[(ranks, sharding, extra)][2])

    # Offloaded, AdamW runs on the host step thread while the next forward runs: when, never what.
    in_line, offloaded = (per_step(runs[(2, "full", extra)][2], 0, "loss") for extra in ((), OFFLOADED))
    check("np 2 --cpu-offload (the host step overlapped): the losses of np 2 in line, bit for bit",
          len(in_line) == STEPS and offloaded == in_line, f"{offloaded} vs {in_line}")

    # Memory against the plan, on every rank of the uneven 3-rank run and the 4-rank hybrid, ZeRO-1 and
    # resharded-to-pairs runs.
    for key in ((3, "full", ()), (4, "hybrid:2", ()), (4, "optimizer", ()), (4, "full", RESHARD_TO_PAIRS)):
        code, output, records = runs[key]
        finals, problems = plan_problems(records)
        check(f"np {key[0]} --sharding {' '.join((key[1],) + key[2])}: every rank's memory and traffic equal the plan",
              code == 0 and len(finals) == key[0] and not problems, f"exit {code}; {problems}\n{output}")


def plan_problems(records):
    """The final records of a run's ranks, and where they differ from the plan they hold."""
    finals = [r for r in records if "measured_persistent_bytes" in r]
    problems = []
    for r in finals:
        planned = r["persistent_bytes"] + 8 * r["step_counters"]
        if r["measured_persistent_bytes"] != planned:
            problems.append(f"rank {r['rank']}: persistent {r['measured_persistent_bytes']} != {planned}")
        if r["unsharded_peak_bytes"] > r["planned_unsharded_peak_bytes"]:
            problems.append(f"rank {r['rank']}: gathered peak {r['unsharded_peak_bytes']} > "
                            f"{r['planned_unsharded_peak_bytes']}")
        if r["step_bytes_received"] != r["planned_step_bytes"]:
            problems.append(f"rank {r['rank']}: received {r['step_bytes_received']} != {r['planned_step_bytes']}")
        if r["held_after_forward_bytes"] != r["planned_held_after_forward_bytes"]:
            problems.append(f"rank {r['rank']}: held from forward to backward {r['held_after_forward_bytes']} "
                            f"!= {r['planned_held_after_forward_bytes']}")
        if r.get("tensor_parallel_step_bytes") != r.get("planned_tensor_parallel_step_bytes"):
            problems.append(f"rank {r['rank']}: tensor-parallel bytes {r.get('tensor_parallel_step_bytes')} != "
                            f"{r.get('planned_tensor_parallel_step_bytes')}")
    return finals, problems


# (ranks, --tp, extra flags, the reference's flags): consecutive ranks form the tensor-parallel groups. The
# 2 x 2 runs print the plan (--explain), whose bytes per rank and step both dimensions must meet.
TP_RUNS = [(2, 2, (), ()), (4, 2, ("--explain",), ()), (4, 2, ("--activation-checkpointing", "--explain"), ()),
           (4, 2, UNEVEN + ("--explain",), UNEVEN)]


def check_tensor_parallel(mpirun, program, scratch, check):
    references = {}
    for ranks, tp, extra, reference_flags in TP_RUNS:
        if reference_flags not in references:
            metrics = os.path.join(scratch, f"tp-reference{''.join(reference_flags)}.jsonl")
            code, _ = run_job(mpirun, program, 1, BASE_ARGS + ["--metrics", metrics] + list(reference_flags))
            records = read_metrics(metrics) if code == 0 else []
            references[reference_flags] = (per_step(records, 0, "loss"), per_step(records, 0, "grad_norm"))
        losses, norms = references[reference_flags]
        metrics = os.path.join(scratch, f"tp-np{ranks}-tp{tp}{''.join(extra)}.jsonl")
        code, output = run_job(mpirun, program, ranks, BASE_ARGS + ["--tp", str(tp), "--metrics", metrics] + list(extra))
        records = read_metrics(metrics) if code == 0 else []
        good = code == 0 and len(losses) == STEPS and all(
            per_step(records, rank, "loss").keys() == losses.keys()
            and all(close(per_step(records, rank, "loss")[s], losses[s]) for s in losses)
            and all(close(per_step(records, rank, "grad_norm")[s], norms[s]) for s in norms)
            for rank in range(ranks))
        check(f"np {ranks} --tp {tp} {' '.join(extra)}: every rank's losses and gradient norms within {RTOL} of "
              f"1 process", good, f"exit {code}\nexpected {losses}\nrank 0 {per_step(records, 0, 'loss')}\n{output}")
        if "--explain" in extra:
            finals, problems = plan_problems(records)
            check(f"np {ranks} --tp {tp} {' '.join(extra)}: every rank's memory, FSDP traffic (dp) and tensor-parallel "
                  f"traffic (tp) equal the plan", code == 0 and len(finals) == ranks and not problems
                  and "tensor parallel over dp=2 x tp=2" in output and all(
                      "tensor_parallel_step_bytes" in r for r in finals), f"exit {code}; {problems}\n{output}")
    check_tensor_parallel_resume(mpirun, program, scratch, check, references[()][0])
    check_tensor_parallel_trace(mpirun, program, scratch, check)


def check_tensor_parallel_trace(mpirun, program, scratch, check):
    """np 4 --tp 2 --trace: the tensor-parallel collectives on their own track, one step's exactly the design's:
    per decoder layer two all-reduces in forward (the attention's and the MLP's sums) and two in backward (their
    inputs' gradients), the embedding's sum, the head's input gradient and the loss's three."""
    directory = os.path.join(scratch, "tp-trace")
    code, output = run_job(mpirun, program, 4, BASE_ARGS + ["--tp", "2", "--trace", directory, "--trace-steps", "2:2"])
    layers = 2  # the tiny config
    expected = sorted(["all_reduce model.embed_tokens output", "all_reduce lm_head input (input gradient)",
                       "all_reduce cross-entropy max", "all_reduce cross-entropy sum of exponentials",
                       "all_reduce cross-entropy target logit"] +
                      [f"all_reduce model.layers.{i}.{name}" for i in range(layers)
                       for name in ("self_attn.o_proj output", "mlp.down_proj output", "self_attn input (input gradient)",
                                    "mlp input (input gradient)")])
    for rank in range(4):
        try:
            with open(os.path.join(directory, f"trace-rank{rank}.json"), encoding="utf-8") as file:
                events = json.load(file)["traceEvents"]
        except (OSError, ValueError, KeyError) as error:
            events, output = [], f"{output}\n{error}"
        tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        spans = sorted(e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "communication"
                       and e["args"].get("communicator") == "tp")
        on_track = all(tracks.get(e["tid"]) == "communication: tp" for e in events
                       if e["ph"] == "X" and e.get("cat") == "communication" and e["args"].get("communicator") == "tp")
        check(f"np 4 --tp 2 --trace: rank {rank}'s traced step holds exactly the design's {len(expected)} "
              f"tensor-parallel all-reduces, on the track 'communication: tp'",
              code == 0 and spans == expected and on_track, f"exit {code}\n{spans}\n{output}")


# Saved at np 4 --tp 2 (2 x 2); resumed at (ranks, --tp).
TP_RESUMES = [(4, 2), (2, 2), (4, 1), (2, 1)]


def check_tensor_parallel_resume(mpirun, program, scratch, check, reference):
    directory = os.path.join(scratch, "tp-checkpoints")
    code1, output1 = run_job(mpirun, program, 4, BASE_ARGS + ["--tp", "2", "--checkpoint-dir", directory,
                                                               "--checkpoint-every", "5"])
    uninterrupted = os.path.join(scratch, "tp-uninterrupted")
    if os.path.isdir(os.path.join(directory, "step-00000010")):
        os.rename(os.path.join(directory, "step-00000010"), uninterrupted)
    same_layout = per_step(read_metrics(os.path.join(scratch, "tp-np4-tp2--explain.jsonl")), 0, "loss")
    for ranks, tp in TP_RESUMES:
        metrics = os.path.join(scratch, f"tp-resumed-np{ranks}-tp{tp}.jsonl")
        code2, output = run_job(mpirun, program, ranks, BASE_ARGS + ["--tp", str(tp), "--checkpoint-dir", directory,
                                                                     "--resume", "--metrics", metrics])
        resumed = per_step(read_metrics(metrics), 0, "loss")
        if (ranks, tp) == (4, 2):
            ends = [os.path.join(d, f"rank-{r:05d}-of-00004.bin")
                    for r in range(4) for d in (uninterrupted, os.path.join(directory, "step-00000010"))]
            equal = all(os.path.exists(f) for f in ends) and all(
                filecmp.cmp(ends[i], ends[i + 1], shallow=False) for i in range(0, len(ends), 2)) and all(
                resumed[s] == same_layout.get(s) for s in resumed)
            how = "bit for bit, and so are the step-10 rank files"
        else:
            equal, how = all(close(resumed[s], reference[s]) for s in resumed), f"within {RTOL:g} of 1 process"
        ok = code1 == 0 and code2 == 0 and equal and sorted(resumed) == list(range(6, STEPS + 1))
        check(f"saved at np 4 --tp 2, resumed at np {ranks} --tp {tp} from step 5: steps 6-10 {how}", ok,
              f"exit {code1}/{code2}\n{resumed}\n{same_layout}\n{output1}\n{output}")
        shutil.rmtree(os.path.join(directory, "step-00000010"), ignore_errors=True)  # the next resumes from 5


def check_random_tokens(mpirun, program, scratch, check):
    # No corpus is read: the same batches at any world size, and a first loss near ln(vocab) (uniform
    # targets, a model that starts near uniform).
    args = ["--config", "tiny", "--random-tokens", "--seq", "16", "--global-batch", "8", "--steps", "4",
            "--threads", "1"]
    runs = {}
    for ranks in (1, 2):
        metrics = os.path.join(scratch, f"random-np{ranks}.jsonl")
        code, output = run_job(mpirun, program, ranks, args + ["--metrics", metrics])
        runs[ranks] = (code, output, per_step(read_metrics(metrics), 0, "loss"))
    (code1, output1, losses1), (code2, output2, losses2) = runs[1], runs[2]
    first = losses1.get(1, float("nan"))
    check(f"--random-tokens: the first loss {first:.3f} is within 0.3 of ln(259) = {math.log(259):.3f}, no corpus "
          "read", code1 == 0 and abs(first - math.log(259)) < 0.3 and "no documents" in output1
          and "random token ids" in output1, f"exit {code1}\n{losses1}\n{output1}")
    check("--random-tokens at np 2: every step's loss within 1e-5 of one process's",
          code2 == 0 and len(losses2) == 4 and losses1.keys() == losses2.keys()
          and all(close(losses2[step], losses1[step]) for step in losses1), f"exit {code2}\n{losses1}\n{losses2}\n{output2}")


def check_sgd(mpirun, program, scratch, check):
    # --optimizer sgd: the loss falls, 3 ranks give one process's losses, and the plan counts the
    # momentum buffer (4 B per element; none at --momentum 0) to the byte.
    args = ["--config", "tiny", "--random-tokens", "--seq", "16", "--global-batch", "6", "--steps", "6",
            "--threads", "1", "--optimizer", "sgd", "--lr", "0.5"]
    runs = {}
    for ranks, extra in ((1, ()), (3, ()), (3, ("--momentum", "0"))):
        metrics = os.path.join(scratch, f"sgd-np{ranks}{''.join(extra)}.jsonl")
        code, output = run_job(mpirun, program, ranks, args + list(extra) + ["--metrics", metrics])
        records = read_metrics(metrics)
        runs[(ranks, extra)] = (code, output, per_step(records, 0, "loss"), records)
    code1, output1, losses1, _ = runs[(1, ())]
    check("--optimizer sgd: 6 steps, the loss falls", code1 == 0 and len(losses1) == 6 and losses1[6] < losses1[1],
          f"exit {code1}\n{losses1}\n{output1}")
    code3, output3, losses3, records3 = runs[(3, ())]
    check("--optimizer sgd at np 3: every step's loss within 1e-5 of one process's",
          code3 == 0 and losses3.keys() == losses1.keys() and all(close(losses3[s], losses1[s]) for s in losses1),
          f"exit {code3}\n{losses1}\n{losses3}\n{output3}")
    for (ranks, extra), per_element in (((3, ()), 4), ((3, ("--momentum", "0")), 0)):
        code, output, _, records = runs[(ranks, extra)]
        finals, problems = plan_problems(records)
        check(f"--optimizer sgd{''.join(' ' + e for e in extra)} at np 3: every rank's memory equals the plan, "
              f"{per_element} B of optimizer state per element",
              code == 0 and len(finals) == 3 and not problems
              and all(r["plan"]["optimizer_state_bytes_per_element"] == per_element for r in finals),
              f"exit {code}; {problems}\n{output}")


# A Llama of 12.4 M parameters (50 MB in f32): big enough that one whole copy stands out in a
# process's peak resident memory.
MID_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 512,
              "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
INIT_FROM_RUNS = [(1, ()), (2, ()), (3, ()), (4, ()), (2, ("--tp", "2")), (4, ("--tp", "2"))]


def check_init_from_memory(mpirun, program, scratch, check):
    """--init-from reads just each rank's shards from the files: every rank's allocator peak and largest
    allocation are the random init's to the byte, and its peak resident memory (VmHWM, which also
    counts what no allocator sees) the random init's within a quarter of one whole copy of the model."""
    config = os.path.join(scratch, "mid.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump(MID_CONFIG, f)
    saved = os.path.join(scratch, "mid-model")
    args = ["--random-tokens", "--seq", "16", "--global-batch", "8", "--steps", "1", "--threads", "1"]
    code, output = run_job(mpirun, program, 1, ["--config", config] + args + ["--save-model", saved])
    weights = os.path.join(saved, "model.safetensors")
    check("a 12.4 M-parameter Llama saved for --init-from", code == 0 and os.path.exists(weights), f"exit {code}\n{output}")
    if code != 0 or not os.path.exists(weights):
        return
    whole = os.path.getsize(weights)
    for ranks, extra in INIT_FROM_RUNS:
        finals = {}
        for source in ("init", "random"):
            metrics = os.path.join(scratch, f"mid-{source}-np{ranks}{''.join(extra)}.jsonl")
            origin = ["--init-from", saved] if source == "init" else ["--config", config]
            code, output = run_job(mpirun, program, ranks, origin + args + list(extra) + ["--metrics", metrics])
            finals[source] = (code, output, {r["rank"]: r for r in read_metrics(metrics) if "peak_resident_bytes" in r})
        (code, output, init), (random_code, random_output, random) = finals["init"], finals["random"]
        flags = " ".join(extra)
        complete = code == 0 and random_code == 0 and len(init) == ranks and len(random) == ranks
        allocator = complete and all(init[r][key] == random[r][key] for r in init
                                     for key in ("train_peak_memory_bytes", "largest_allocation_bytes"))
        extra_resident = [init[r]["peak_resident_bytes"] - random[r]["peak_resident_bytes"] for r in init] \
            if complete else []
        check(f"np {ranks} {flags}: --init-from's allocator peak and largest allocation equal the random init's on "
              "every rank", allocator, f"exit {code}/{random_code}\n{init}\n{random}\n{output}")
        check(f"np {ranks} {flags}: --init-from's peak resident memory is the random init's within a quarter of one "
              f"whole copy ({whole} B): {max(extra_resident, default=None)} B more at most",
              complete and max(extra_resident) < whole / 4, f"{extra_resident}\n{output}\n{random_output}")


def check_mixed_precision(mpirun, program, scratch, check):
    # bf16 gathers and compute with f32 master shards: the same curve as f32 up to bf16 rounding.
    metrics = os.path.join(scratch, "bf16.jsonl")
    code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--mixed-precision", "bf16", "--metrics", metrics])
    losses = per_step(read_metrics(metrics), 0, "loss")
    reference = per_step(read_metrics(os.path.join(scratch, "np1_full.jsonl")), 0, "loss")
    ok = code == 0 and len(losses) == STEPS and all(abs(losses[s] - reference[s]) < 0.05 for s in reference)
    check("np 2 --mixed-precision bf16: every step's loss within 0.05 of the f32 run's", ok,
          f"exit {code}\n{losses}\n{reference}\n{output}")
    check_golden(check, "train_llama_steps.json", "train_llama np 2 --mixed-precision bf16", read_metrics(metrics))


def check_resume(mpirun, program, scratch, check):
    # Save every 5 steps, drop the last checkpoint, resume from step 5: the same losses as the
    # uninterrupted run, bit for bit at the same world size; at another one the gradient averages
    # sum in another order, so within float tolerance.
    reference = per_step(read_metrics(os.path.join(scratch, "np1_full.jsonl")), 0, "loss")
    for save_ranks, resume_ranks in ((2, 2), (4, 4), (4, 2)):
        directory = os.path.join(scratch, f"checkpoints_{save_ranks}_{resume_ranks}")
        code1, _ = run_job(mpirun, program, save_ranks,
                           BASE_ARGS + ["--checkpoint-dir", directory, "--checkpoint-every", "5"])
        kept = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        # The uninterrupted run's last checkpoint moves aside (its parameters and Adam state, for
        # comparing), so that --resume takes step 5.
        uninterrupted = os.path.join(scratch, f"uninterrupted_{save_ranks}_{resume_ranks}")
        if os.path.isdir(os.path.join(directory, "step-00000010")):
            os.rename(os.path.join(directory, "step-00000010"), uninterrupted)
        metrics = os.path.join(scratch, f"resumed_{save_ranks}_{resume_ranks}.jsonl")
        code2, output = run_job(mpirun, program, resume_ranks,
                                BASE_ARGS + ["--checkpoint-dir", directory, "--resume", "--metrics", metrics])
        resumed = per_step(read_metrics(metrics), 0, "loss")
        same = per_step(read_metrics(os.path.join(scratch, f"np{resume_ranks}_full.jsonl")), 0, "loss")
        if save_ranks == resume_ranks:
            # Same world size, same layout: the rank files of step 10 are the same bytes.
            ends = [os.path.join(d, f"rank-{r:05d}-of-{save_ranks:05d}.bin")
                    for r in range(save_ranks) for d in (uninterrupted, os.path.join(directory, "step-00000010"))]
            same_end = all(os.path.exists(f) for f in ends) and all(
                filecmp.cmp(ends[i], ends[i + 1], shallow=False) for i in range(0, len(ends), 2))
            equal = all(resumed[s] == same.get(s) for s in resumed) and same_end
            how = "bit for bit, and so are the parameters and Adam state saved at step 10"
        else:
            equal, how = all(close(resumed[s], reference[s]) for s in resumed), f"within {RTOL:g}"
        ok = (code1 == 0 and code2 == 0 and kept == ["step-00000005", "step-00000010"] and equal
              and sorted(resumed) == list(range(6, STEPS + 1)) and "resumed from" in output)
        check(f"save at np {save_ranks} every 5 steps, resume at np {resume_ranks} from step 5: steps 6-10 equal "
              f"the uninterrupted run {how}", ok, f"exit {code1}/{code2}, kept {kept}\n{resumed}\n{same}\n{output}")

    directory = os.path.join(scratch, "keep")
    code, output = run_job(mpirun, program, 1, BASE_ARGS + ["--checkpoint-dir", directory, "--checkpoint-every", "2",
                                                            "--keep", "2"])
    kept = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    check("--checkpoint-every 2 --keep 2 keeps the newest two", code == 0 and kept == ["step-00000008",
                                                                                       "step-00000010"],
          f"exit {code}, kept {kept}\n{output}")

    # A directory rank 0 cannot create fails every rank before step 1, explained once.
    for flag in ("--checkpoint-dir", "--save-model"):
        code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--steps", "1", flag, "/dev/null/out"])
        message = f"train_llama: {flag} '/dev/null/out': cannot create the directory: Not a directory"
        ok = code == 1 and output.count(message) == 1 and "median step" not in output
        check(f"np 2 {flag} under a file fails on every rank before step 1, explained once", ok,
              f"exit {code}\n{output}")

    empty = os.path.join(scratch, "empty")
    code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--checkpoint-dir", empty, "--resume"])
    message = f"train_llama: --resume: no complete checkpoint in '{empty}'"
    check("--resume without a checkpoint fails, explained once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")


def check_profile(mpirun, program, scratch, check):
    """--profile: the table on rank 0, and every rank's kernel totals within the profiled steps' time,
    the same losses as without it (it only reads the clock)."""
    metrics = os.path.join(scratch, "profile.jsonl")
    code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--profile", "--metrics", metrics])
    records = read_metrics(metrics)
    profiles = {r["rank"]: r for r in records if "kernels" in r}
    reference = per_step(read_metrics(os.path.join(scratch, "np2_full.jsonl")), 0, "loss")
    problems = []
    for rank, r in sorted(profiles.items()):
        kernel_seconds = sum(k["seconds"] for k in r["kernels"])
        ops = {k["op"] for k in r["kernels"]}
        if r["profile_steps"] != STEPS - 1 or not 0 < kernel_seconds <= r["profile_seconds"]:
            problems.append(f"rank {rank}: {r['profile_steps']} steps, kernels {kernel_seconds} s of {r['profile_seconds']} s")
        if not {"matmul", "attention_forward", "adam_step"} <= ops:
            problems.append(f"rank {rank}: ops {sorted(ops)}")
        # On the CPU the categories share out the kernels' host time, and the host gaps are the rest.
        split = {c["category"]: c["seconds"] for c in r.get("categories", [])}
        gaps = split.pop("host gaps", None)
        if (not {"GEMM", "attention", "optimizer", "elementwise", "reductions", "indexing"} <= split.keys()
                or abs(sum(split.values()) - kernel_seconds) > 1e-9 * kernel_seconds
                or gaps is None or abs(gaps - (r["profile_seconds"] - kernel_seconds)) > 1e-9 * r["profile_seconds"]):
            problems.append(f"rank {rank}: categories {split}, host gaps {gaps}")
    ok = (code == 0 and sorted(profiles) == [0, 1] and not problems and output.count("kernel time per step") == 1
          and "outside kernels" in output and "by category" in output and per_step(records, 0, "loss") == reference)
    check("np 2 --profile: rank 0's tables (per op, by category), every rank's kernel totals within the steps' "
          "time and shared out by category, the same losses",
          ok, f"exit {code}; {problems}\n{output}")


def check_checkpointing(mpirun, program, scratch, check):
    outcomes = []
    for flag in ([], ["--activation-checkpointing"]):
        metrics = os.path.join(scratch, f"ac{len(flag)}.jsonl")
        code, output = run_job(mpirun, program, 2, BASE_ARGS + flag + ["--metrics", metrics])
        records = read_metrics(metrics)
        outcomes.append((code, output, per_step(records, 0, "loss"), per_step(records, 0, "grad_norm")))
    (code0, _, loss0, norm0), (code1, output1, loss1, norm1) = outcomes
    check("np 2 --activation-checkpointing: the same losses and gradient norms, bit for bit",
          code0 == 0 and code1 == 0 and loss0 and loss0 == loss1 and norm0 == norm1,
          f"exit {code0}/{code1}\n{loss0}\n{loss1}\n{norm0}\n{norm1}\n{output1}")


def check_save_and_generate(mpirun, program, generate, scratch, check):
    saved = os.path.join(scratch, "saved")
    code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--save-model", saved, "--sample", "1",
                                                            "--sample-tokens", "20"])
    files = sorted(os.listdir(saved)) if os.path.isdir(saved) else []
    check("np 2 --save-model writes config.json and model.safetensors; --sample prints a sample",
          code == 0 and files == ["config.json", "model.safetensors"] and "--- sample 1 ---" in output,
          f"exit {code}, files {files}\n{output}")

    code, output = run_command([generate, saved, "--prompt", "Q:", "--samples", "2", "--tokens", "16",
                                "--print-ids"])
    ids = [line[len("ids: "):].split() for line in output.splitlines() if line.startswith("ids: ")]
    check("generate samples twice from the saved directory, with their ids", code == 0 and
          output.count("--- sample") == 2 and len(ids) == 2 and all(0 < len(row) <= 16 for row in ids),
          f"exit {code}\n{output}")
    check_scoring(generate, saved, scratch, check)
    check_generate_over_ranks(mpirun, generate, saved, scratch, check)

    # Starting from the saved model, the first step's loss is the trained model's, well below a
    # fresh model's first loss.
    metrics = os.path.join(scratch, "init_from.jsonl")
    data_args = BASE_ARGS[2:8]  # --seq, --global-batch, --limit-documents: the config comes from the directory
    code, output = run_job(mpirun, program, 2, data_args + ["--steps", "1", "--threads", "1", "--init-from", saved,
                                                            "--metrics", metrics])
    first = per_step(read_metrics(metrics), 0, "loss").get(1)
    fresh = per_step(read_metrics(os.path.join(scratch, "np1_full.jsonl")), 0, "loss").get(1)
    check("np 2 --init-from the saved directory starts where training ended",
          code == 0 and first is not None and fresh is not None and first < fresh - 0.5,
          f"exit {code}, first loss {first} vs a fresh model's {fresh}\n{output}")


def read_safetensors(path):
    """{name: (shape, flat values)} of a safetensors file of f32 and i64 tensors."""
    formats = {"F32": "f", "I64": "q"}
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        code = formats[entry["dtype"]]
        tensors[name] = (entry["shape"], struct.unpack(f"<{(end - begin) // struct.calcsize(code)}{code}",
                                                       data[begin:end]))
    return tensors


def check_scoring(generate, saved, scratch, check):
    """generate --logits: [BOT] + the prompt's bytes and their logits in the file, and the printed
    loss the mean cross-entropy of each next id, recomputed here from the logits in double."""
    path = os.path.join(scratch, "scored.safetensors")
    prompt = "Q: Why do fortunes end?"
    code, output = run_command([generate, saved, "--prompt", prompt, "--logits", path])
    printed = re.search(r"scored (\d+) tokens: loss ([-\d.e+]+)", output)
    tensors = read_safetensors(path) if code == 0 and os.path.isfile(path) else {}
    expected_ids = [256] + list(prompt.encode())
    loss = None
    if "logits" in tensors and "ids" in tensors:
        (rows, vocab), logits = tensors["logits"]
        ids = list(tensors["ids"][1])
        if ids == expected_ids and rows == len(ids):
            terms = []
            for i in range(rows - 1):
                row = logits[i * vocab:(i + 1) * vocab]
                top = max(row)
                terms.append(top + math.log(sum(math.exp(v - top) for v in row)) - row[ids[i + 1]])
            loss = sum(terms) / len(terms)
    check("generate --logits writes [BOT] + the prompt's ids and their logits, and prints their mean loss",
          printed is not None and loss is not None and abs(float(printed.group(2)) - loss) <= 1e-5 * loss,
          f"exit {code}, recomputed loss {loss}\n{output}")


def check_generate_over_ranks(mpirun, generate, saved, scratch, check):
    """generate under mpirun shards the model over the ranks (each reading its shards): at np 2 and 3
    the logits file is one process's bit for bit, the sampled texts and ids the same, printed once; a
    refusal is printed once."""
    prompt = "Q: Why do fortunes end?"
    alone_logits = os.path.join(scratch, "alone.safetensors")
    code, _ = run_command([generate, saved, "--prompt", prompt, "--logits", alone_logits, "--threads", "1"])
    sample = ["--prompt", "Q:", "--samples", "2", "--tokens", "16", "--print-ids", "--threads", "1"]
    _, alone_samples = run_command([generate, saved] + sample)
    for ranks in (2, 3):
        path = os.path.join(scratch, f"np{ranks}.safetensors")
        code_l, output_l = run_job(mpirun, generate, ranks, [saved, "--prompt", prompt, "--logits", path,
                                                             "--threads", "1"])
        same = code == 0 and code_l == 0 and os.path.isfile(path) and read_safetensors(path) == read_safetensors(
            alone_logits)
        check(f"generate at np {ranks}: each rank reads its shards, the logits are one process's bit for bit, "
              "printed once", same and "read each rank's shards" in output_l and output_l.count("scored ") == 1,
              f"exit {code_l}\n{output_l}")
        code_s, output_s = run_job(mpirun, generate, ranks, [saved] + sample)
        texts = [line for line in output_s.splitlines() if not line.startswith("generate: read each")]
        check(f"generate at np {ranks}: the same 2 samples and ids as one process, printed once",
              code_s == 0 and texts == alone_samples.splitlines(), f"exit {code_s}\n{output_s}\n{alone_samples}")
    code, output = run_job(mpirun, generate, 2, [os.path.join(scratch, "no-such-model")])
    check("generate at np 2: a missing directory is refused in one line",
          code != 0 and output.count("has no config.json") == 1, f"exit {code}\n{output}")


def check_bpe(mpirun, program, generate, scratch, check):
    runs = {}
    for ranks in (1, 2):
        metrics = os.path.join(scratch, f"bpe_np{ranks}.jsonl")
        saved = os.path.join(scratch, f"bpe_np{ranks}")
        code, output = run_job(mpirun, program, ranks, BASE_ARGS + [
            "--tokenizer", "bpe:512", "--metrics", metrics, "--save-model", saved, "--checkpoint-dir",
            os.path.join(scratch, f"bpe_checkpoints_np{ranks}")])
        tokenizer = os.path.join(saved, "tokenizer.json")
        with open(tokenizer, "rb") if os.path.isfile(tokenizer) else open(os.devnull, "rb") as f:
            runs[ranks] = (code, output, per_step(read_metrics(metrics), 0, "loss"), f.read())
    (code1, _, losses1, tokenizer1), (code2, output2, losses2, tokenizer2) = runs[1], runs[2]
    ok = (code1 == 0 and code2 == 0 and b'"[EOT]"' in tokenizer1 and tokenizer1 == tokenizer2
          and "(bpe:512 tokenizer, vocab 512)" in output2 and len(losses2) == STEPS
          and all(close(losses2[s], losses1[s]) for s in losses1))
    check("np 2 --tokenizer bpe:512: the tokenizer.json one process learns, the same step losses", ok,
          f"exit {code1}/{code2}\n{losses1}\n{losses2}\n{output2}")

    saved = os.path.join(scratch, "bpe_np2")
    code, output = run_command([generate, saved, "--prompt", "Q:", "--samples", "2", "--tokens", "16"])
    check("generate reads the saved directory's tokenizer.json", code == 0 and output.count("--- sample") == 2,
          f"exit {code}\n{output}")

    code, output = run_job(mpirun, program, 2, BASE_ARGS[2:8] + ["--steps", "1", "--threads", "1", "--init-from", saved])
    check("--init-from a BPE directory takes its tokenizer.json",
          code == 0 and f"({saved}/tokenizer.json tokenizer, vocab 512)" in output, f"exit {code}\n{output}")

    directory = os.path.join(scratch, "bpe_checkpoints_np2")
    code, output = run_job(mpirun, program, 2, BASE_ARGS + ["--steps", str(STEPS + 2), "--tokenizer", "bpe:600",
                                                            "--checkpoint-dir", directory, "--resume"])
    message = "train_llama: --resume: tokenizer_json was \"{"
    check("--resume with another tokenizer fails, explained once (the tokenizer.json shortened)",
          code == 1 and output.count(message) == 1 and "bytes) when '" in output, f"exit {code}\n{output}")


# (ranks, sharding, extra flags) of the predicted-peak runs: every strategy at np 1-4, with and
# without activation checkpointing.
FIT_RUNS = [(ranks, sharding, extra) for ranks in (1, 2, 3, 4)
            for sharding in ("full", "grad_op", "optimizer", "none", "hybrid:2" if ranks % 2 == 0 else "hybrid:1")
            for extra in ((), ("--activation-checkpointing",))]
FIT_ARGS = ["--config", "tiny", "--seq", "48", "--global-batch", "12", "--limit-documents", "240",
            "--steps", "2", "--threads", "1"]


def check_will_it_fit(mpirun, program, scratch, check):
    for ranks, sharding, extra in FIT_RUNS:
        name = " ".join([f"np {ranks}", sharding, *extra])
        metrics = os.path.join(scratch, f"fit-{ranks}-{sharding}-{len(extra)}.jsonl")
        code, output = run_job(mpirun, program, ranks,
                               FIT_ARGS + ["--sharding", sharding, *extra, "--explain", "--metrics", metrics])
        if code != 0:
            check(f"{name} --explain trains", False, f"exit {code}\n{output}")
            continue
        check_peak(check, name, read_metrics(metrics), ranks)

    check_dry_runs_change_nothing(check, mpirun, program, 2, FIT_ARGS + ["--steps", "3"], scratch,
                                  lambda path: os.path.join(path, "model.safetensors"))
    check_memory_limit(check, mpirun, program, 2, FIT_ARGS, scratch)


# The checks check_traces makes (skipped without the data set): the run, trace_checks.check_trace's
# for 2 ranks, and the two refusals.
TRACE_CHECKS = 30


def check_traces(mpirun, program, scratch, check):
    check_trace_run(mpirun, program, "train_llama", BASE_ARGS, scratch, check)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: train_llama_tests.py <mpirun> <train_llama> <generate>")
    sys.exit(main(*sys.argv[1:]))
