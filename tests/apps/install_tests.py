#!/usr/bin/env python3
"""tests/apps/install_tests.py: shardlab as a library another project builds against, as its users
would: `meson install` of this build into a scratch directory (DESTDIR), then examples/custom_model
copied out of the tree and built against the installed files, and checks that:

- the install holds the public headers under include/shardlab/ (every library header whose first
  line does not say "internal to" and no other, no test or app headers, every header they include
  installed too), real (not thin) static archives, the user-facing programs (no bench_*), shardlab.pc
  and the CMake package;
- the example builds with Meson through pkg-config (dependency('shardlab')), trains under mpirun at
  np 1, 2 and 3 (an uneven split of its batch) with every step's loss within 1e-5 of np 1's, and its loss falls to under
  half its first value;
- where cmake is installed, the example builds with CMake through shardlabConfig.cmake
  (find_package(shardlab), shardlab::shardlab) and prints the losses of the Meson-built one;
- the example configures with shardlab as its Meson subproject (dependency('shardlab') answered by
  meson.override_dependency); configured only, as building shardlab again would take minutes;
- a program of its own (tests/apps/installed_table) linked against the installed static archives has
  every entry of the CPU kernel table set (each family's entries come from a function the table calls,
  so the linker cannot drop them);
- examples/ladder builds against the installed shardlab.pc, and every rung prints rung 1's losses,
  which fall: rung 2 (FSDP) at np 2, rung 3 (bf16, activation checkpointing) at np 2 within 2e-2,
  rung 4 saved after step 10 at np 2 and resumed at np 3, rung 5 at np 4 as dp 2 x tp 2 (within 1e-5);
  each rung refuses what it cannot do, saying so.

Usage: install_tests.py <mpirun> <meson> <build dir> <source dir>. Prints one line per check, then
"install: N passed, N failed, N skipped".
"""
import json
import os
import re
import shutil
import sys
import tempfile

from jobs import Checks, run_command, run_job

STEPS = 20
RTOL = 1e-5
EXAMPLE_FILES = ["meson.build", "CMakeLists.txt", "custom_model.cpp"]
# Every build has these; dist's archive and the MPI programs are checked only where MPI is built
# (this test is, tests/meson.build registers it with MPI only).
ARCHIVES = ["models", "dist", "optim", "nn", "autograd", "data", "core"]
LAYERS = ["core", "autograd", "nn", "optim", "data", "dist", "models"]
PROGRAMS = ["train_cnn", "train_llama", "generate", "checkpoint"]
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def losses(output):
    return [float(loss) for _, loss in STEP_LINE.findall(output)]


def close(actual, expected):
    return len(actual) == len(expected) == STEPS and all(
        abs(a - e) <= RTOL * abs(e) for a, e in zip(actual, expected))  # NaN compares false: it fails


def find_one(root, name):
    """The one path under root whose file name is `name` (None when there is not exactly one)."""
    found = [os.path.join(d, name) for d, _, files in os.walk(root) if name in files]
    return found[0] if len(found) == 1 else None


def public_headers(source_dir):
    """The library headers of the source tree whose first line does not say "internal to"."""
    public = set()
    for layer in LAYERS:
        for d, _, files in os.walk(os.path.join(source_dir, layer)):
            for name in files:
                if name.endswith((".h", ".cuh")):
                    with open(os.path.join(d, name), encoding="utf-8") as f:
                        if "internal to" not in f.readline():
                            public.add(os.path.relpath(os.path.join(d, name), source_dir))
    return public


def check_layout(check, prefix, source_dir):
    include = os.path.join(prefix, "include", "shardlab")
    headers = sorted(os.path.relpath(os.path.join(d, f), include)
                     for d, _, files in os.walk(include) for f in files)
    forgotten = sorted(public_headers(source_dir) - set(headers))
    check("every public header is installed (a new one goes in its layer's install_headers)", not forgotten,
          "\n".join(forgotten))
    check("headers installed under include/shardlab/ as the tree names them",
          {"core/tensor.h", "nn/module.h", "dist/fsdp/fsdp.h", "optim/optimizer.h", "models/llama.h",
           "data/loader.h", "autograd/variable.h"} <= set(headers), "\n".join(headers))
    internal, dangling = [], []
    for header in headers:
        with open(os.path.join(include, header), encoding="utf-8") as f:
            text = f.read()
        if "internal to" in text.splitlines()[0]:
            internal.append(header)
        dangling += [f"{header} includes {name}" for name in re.findall(r'#include "([^"]+)"', text)
                     if not os.path.exists(os.path.join(include, name))]
    check("no internal, test or app header installed",
          not internal and not any(h.startswith(("tests/", "apps/")) for h in headers), "\n".join(internal))
    check("every header an installed header includes is installed", not dangling, "\n".join(dangling))

    archives = {name: find_one(prefix, f"libshardlab_{name}.a") for name in ARCHIVES}
    not_archives = []
    for name, path in archives.items():
        if path is None:
            not_archives.append(f"libshardlab_{name}.a is missing")
            continue
        with open(path, "rb") as f:
            # A thin archive names object files in the build tree: useless once installed.
            if f.read(8) != b"!<arch>\n":
                not_archives.append(f"{path} is no archive (thin?)")
    check("the static libraries are installed as real archives", not not_archives, "\n".join(not_archives))
    missing = [p for p in PROGRAMS if not os.access(os.path.join(prefix, "bin", p), os.X_OK)]
    check("train_cnn, train_llama, generate and checkpoint installed in bin/", not missing, f"missing {missing}")
    benches = [p for p in os.listdir(os.path.join(prefix, "bin")) if p.startswith("bench_")]
    check("no bench_* program installed", not benches, f"{benches}")
    return find_one(prefix, "shardlab.pc"), find_one(prefix, "shardlabConfig.cmake")


def check_runs(check, mpirun, program, name, reference):
    """The losses of `program` at np 1 and np 2 (and 3, an uneven split of its batch of 64, without a
    reference); checked against each other, and against reference."""
    runs = {}
    for ranks in (1, 2) if reference is not None else (1, 2, 3):
        code, output = run_job(mpirun, program, ranks, ["--steps", str(STEPS)])
        runs[ranks] = losses(output)
        if code != 0 or len(runs[ranks]) != STEPS:
            check(f"{name} trains {STEPS} steps at np {ranks}", False, f"exit {code}\n{output}")
            return None
    one, two = runs[1], runs[2]
    if reference is None:
        check(f"{name}: np 2 gives np 1's losses within {RTOL} (first {one[0]:.8f} / {two[0]:.8f}, "
              f"last {one[-1]:.8f} / {two[-1]:.8f})", close(two, one), f"np 1 {one}\nnp 2 {two}")
        check(f"{name}: np 3 (rows 22/21/21) gives np 1's losses within {RTOL}", close(runs[3], one),
              f"np 1 {one}\nnp 3 {runs[3]}")
        check(f"{name}: the loss falls to under half ({one[0]:.4f} -> {one[-1]:.4f})", one[-1] < 0.5 * one[0])
    else:
        check(f"{name}: np 1 and np 2 give the Meson-built example's losses within {RTOL}",
              close(one, reference) and close(two, reference), f"np 1 {one}\nnp 2 {two}\nmeson {reference}")
    return one


LADDER = ["01_one_process", "02_fully_shard", "03_mixed_precision", "04_checkpoint", "05_tensor_parallel"]
BF16_RTOL = 2e-2


def check_ladder(check, mpirun, meson, scratch, source_dir, env):
    """examples/ladder built against the staged install, and each rung's losses against rung 1's."""
    ladder = os.path.join(scratch, "ladder")
    shutil.copytree(os.path.join(source_dir, "examples", "ladder"), ladder)
    build = os.path.join(scratch, "ladder-build")
    code, output = run_command([meson, "setup", build, ladder], env)
    if code == 0:
        code, output = run_command(["ninja", "-C", build, "-j2"], env)
    check("examples/ladder builds with Meson against the installed shardlab.pc", code == 0, f"exit {code}\n{output}")
    if code != 0:
        return

    def rung(name, ranks, *args):
        code, output = run_job(mpirun, os.path.join(build, name), ranks, ["--steps", str(STEPS), *args])
        return code, output, losses(output)

    code, output, one = rung(LADDER[0], 1)
    check(f"rung 1 trains {STEPS} steps in one process, its loss falling to under half ({one[0] if one else None} "
          f"-> {one[-1] if one else None})", code == 0 and len(one) == STEPS and one[-1] < 0.5 * one[0],
          f"exit {code}\n{output}")
    if len(one) != STEPS:
        return

    def same_as_rung_1(what, code, output, got, rtol=RTOL):
        ok = code == 0 and len(got) == STEPS and all(abs(a - e) <= rtol * abs(e) for a, e in zip(got, one))
        check(f"{what} prints rung 1's losses within {rtol}", ok, f"exit {code}\n{output}\nrung 1 {one}")

    same_as_rung_1("rung 2 (FSDP) at np 2", *rung(LADDER[1], 2))
    same_as_rung_1("rung 3 (bf16, activation checkpointing) at np 2", *rung(LADDER[2], 2), rtol=BF16_RTOL)
    checkpoint = os.path.join(scratch, "ladder-checkpoint")
    code, saved_output, saved = rung(LADDER[3], 2, "--save-at", "10", "--dir", checkpoint)
    _, resumed_output, resumed = rung(LADDER[3], 3, "--resume", checkpoint)
    same_as_rung_1("rung 4 saved after step 10 at np 2 and resumed at np 3", code, saved_output + resumed_output,
                   saved + resumed)
    same_as_rung_1("rung 5 (tensor parallel x FSDP) at np 4 as dp 2 x tp 2", *rung(LADDER[4], 4, "--tp", "2"))

    refusals = [(LADDER[0], 2, [], "01_one_process: trains in one process, not 2"),
                (LADDER[3], 1, [], "04_checkpoint: give --save-at K with --dir D, or --resume D"),
                (LADDER[3], 1, ["--dir"], "04_checkpoint: --dir wants a value"),
                (LADDER[4], 4, ["--tp", "3"], "05_tensor_parallel: --tp 3 does not divide the 4 ranks"),
                (LADDER[1], 1, ["--steps", "0"], "02_fully_shard: --steps wants a positive integer, got '0'")]
    for name, ranks, args, message in refusals:
        code, output = run_job(mpirun, os.path.join(build, name), ranks, args)
        check(f"{name} {' '.join(args)} at np {ranks} is refused: {message}", code not in (0, None) and message in output,
              f"exit {code}\n{output}")


def check_kernel_table(check, meson, scratch, source_dir, env):
    """tests/apps/installed_table built against the staged install: every CPU kernel entry is linked in."""
    project = os.path.join(scratch, "installed_table")
    shutil.copytree(os.path.join(source_dir, "tests", "apps", "installed_table"), project)
    build = os.path.join(scratch, "installed_table-build")
    code, output = run_command([meson, "setup", build, project], env)
    if code == 0:
        code, output = run_command(["ninja", "-C", build, "-j1"], env)
    if code == 0:
        code, output = run_command([os.path.join(build, "installed_table")], env)
    counted = re.search(r"the CPU kernel table: (\d+) of (\d+) entries set", output)
    check(f"a program linked against the installed static archives has every CPU kernel entry "
          f"({counted.group(1) if counted else '?'} of {counted.group(2) if counted else '?'})",
          code == 0 and counted is not None and counted.group(1) == counted.group(2), f"exit {code}\n{output}")


def main(mpirun, meson, build_dir, source_dir):
    check = Checks()
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="install_tests.") as scratch:
        stage = os.path.join(scratch, "stage")
        code, output = run_command([meson, "install", "-C", build_dir, "--no-rebuild", "--quiet",
                                    "--destdir", stage])
        check("meson install --destdir", code == 0, f"exit {code}\n{output}")
        if code != 0:
            return check.summary("install", skipped)
        options = {o["name"]: o["value"] for o in json.loads(
            run_command([meson, "introspect", build_dir, "--buildoptions"])[1])}
        prefix = stage + options["prefix"]
        pc_file, cmake_config = check_layout(check, prefix, source_dir)

        example = os.path.join(scratch, "custom_model")
        os.makedirs(example)
        for name in EXAMPLE_FILES:
            shutil.copy(os.path.join(source_dir, "examples", "custom_model", name), example)

        # shardlab.pc names the configured prefix, which DESTDIR staging does not change; a copy
        # pointing at the staged tree stands in for the installed one. (PKG_CONFIG_SYSROOT_DIR
        # would also prefix the paths of MPI, which are not staged.)
        pc_dir = os.path.join(scratch, "pkgconfig")
        os.makedirs(pc_dir)
        with open(pc_file, encoding="utf-8") as f:
            pc = f.read()
        check("shardlab.pc starts with its prefix", pc.startswith("prefix="), pc)
        with open(os.path.join(pc_dir, "shardlab.pc"), "w", encoding="utf-8") as f:
            f.write(re.sub(r"^prefix=.*$", f"prefix={prefix}", pc, count=1, flags=re.MULTILINE))

        env = dict(os.environ, PKG_CONFIG_PATH=pc_dir)
        meson_build = os.path.join(scratch, "meson-build")
        code, output = run_command([meson, "setup", meson_build, example], env)
        if code == 0:
            code, output = run_command(["ninja", "-C", meson_build, "-j1"], env)
        check("examples/custom_model builds with Meson against the installed shardlab.pc", code == 0,
              f"exit {code}\n{output}")
        reference = check_runs(check, mpirun, os.path.join(meson_build, "custom_model"), "custom_model (Meson)",
                               None) if code == 0 else None

        cmake = shutil.which("cmake")
        if cmake is None:
            print("skipped: the CMake build, cmake is not installed")
            skipped += 2
        else:
            cmake_build = os.path.join(scratch, "cmake-build")
            code, output = run_command([cmake, "-S", example, "-B", cmake_build, "-DCMAKE_BUILD_TYPE=Release",
                                        f"-DCMAKE_PREFIX_PATH={prefix}"])
            if code == 0:
                code, output = run_command([cmake, "--build", cmake_build])
            check(f"examples/custom_model builds with CMake against {os.path.relpath(cmake_config, prefix)}",
                  code == 0 and cmake_config is not None, f"exit {code}\n{output}")
            if code == 0 and reference is not None:
                check_runs(check, mpirun, os.path.join(cmake_build, "custom_model"), "custom_model (CMake)",
                           reference)
            else:
                skipped += 1

        # The subproject route: subprojects/shardlab is this source tree, and the fallback is forced
        # so that an installed shardlab cannot answer instead.
        os.makedirs(os.path.join(example, "subprojects"))
        os.symlink(os.path.abspath(source_dir), os.path.join(example, "subprojects", "shardlab"))
        code, output = run_command([meson, "setup", os.path.join(scratch, "subproject-build"), example,
                                    "--force-fallback-for=shardlab"])
        check("examples/custom_model configures with shardlab as its subproject (dependency overridden)",
              code == 0 and re.search(r"Dependency shardlab (for host machine )?found: YES", output) is not None
              and "(overridden)" in output,
              f"exit {code}\n{output}")
        check_ladder(check, mpirun, meson, scratch, source_dir, env)
        check_kernel_table(check, meson, scratch, source_dir, env)
    return check.summary("install", skipped)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: install_tests.py <mpirun> <meson> <build dir> <source dir>")
    sys.exit(main(*sys.argv[1:]))
