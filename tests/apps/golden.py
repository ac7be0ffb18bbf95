"""tests/apps/golden.py: runs whose numbers must never change: every step's loss and gradient norm of
rank 0, as the hexadecimal form of their doubles (float.hex), against a committed golden file.

A golden file holds {run name: {step: [loss, grad_norm]}}. With SHARDLAB_RECORD_GOLDEN=1 in the
environment the runs write their entries instead of checking them (done by hand, and committed, only
where a change of the numbers is meant)."""
import json
import os

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
RECORD_ENV = "SHARDLAB_RECORD_GOLDEN"


def step_hex(records):
    """{step (as text): [loss, grad_norm]} of rank 0's per-step records, in hexadecimal."""
    return {str(r["step"]): [float(r["loss"]).hex(), float(r["grad_norm"]).hex()]
            for r in records if r.get("rank") == 0 and "step" in r and "loss" in r}


def read_golden(file_name):
    path = os.path.join(GOLDEN_DIR, file_name)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as golden:
        return json.load(golden)


def check_golden(check, file_name, run_name, records):
    """Checks (or with SHARDLAB_RECORD_GOLDEN=1 records) the run's step values against the file's."""
    actual = step_hex(records)
    if os.environ.get(RECORD_ENV) == "1":
        golden = read_golden(file_name)
        golden[run_name] = actual
        with open(os.path.join(GOLDEN_DIR, file_name), "w", encoding="utf-8") as out:
            json.dump(golden, out, indent=1, sort_keys=True)
            out.write("\n")
        return
    expected = read_golden(file_name).get(run_name)
    wrong = [f"step {s}: {actual.get(s)} vs {v}" for s, v in (expected or {}).items() if actual.get(s) != v]
    check(f"{run_name}: every step's loss and gradient norm equal the golden ones as bits "
          f"(tests/apps/golden/{file_name})", bool(expected) and actual.keys() == expected.keys() and not wrong,
          "no golden entry" if not expected else "; ".join(wrong[:4]) or f"steps {sorted(actual)}")
