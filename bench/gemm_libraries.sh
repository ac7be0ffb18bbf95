#!/usr/bin/env bash
# bench/gemm_libraries.sh: the Llama benchmark's GEMMs on shardlab's GEMM, BLIS 0.9 and oneDNN 2.6
# (Debian 12's libblis-dev and libdnnl-dev, installed here if missing), at THREADS threads (default 2),
# and torch.mm's column when the peers' environment exists (scripts/peers). Then whether each keeps
# its result bits across thread counts (1, 2, 4, 8, 16) and instruction sets (AVX2 instead of the
# widest, through SHARDLAB_CPU_ISA and ONEDNN_MAX_CPU_ISA; BLIS's stays its own pick), shape by shape.
# Needs the build of shardlab's core (scripts/build). Prints both; nothing of it enters shardlab's
# build.
#
# Usage: bench/gemm_libraries.sh [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
if ! dpkg -s libblis-dev libdnnl-dev > /dev/null 2>&1; then
  apt-get update -q && apt-get install -y -q libblis-dev libdnnl-dev
fi
[[ -f build/core/libshardlab_core.a ]] || { echo "gemm_libraries.sh: build shardlab first (scripts/build)" >&2; exit 1; }
program=$(mktemp -d)/gemm_libraries
g++ -O2 -std=c++20 -I. -Ibuild bench/gemm_libraries.cpp build/core/libshardlab_core.a -lblis -ldnnl -lfmt \
  -lpthread -o "$program"
# Both libraries run on OpenMP; its threads wait passively so the next library's have the cores.
table=$(OMP_NUM_THREADS=$threads OMP_WAIT_POLICY=passive "$program" "$threads")
peers_python=${SHARDLAB_PEERS:-$HOME/.cache/shardlab-peers/venv}/bin/python
if [[ -x $peers_python ]]; then
  echo "$table" | "$peers_python" bench/torch_gemm.py
else
  echo "$table"
fi
echo
echo "result bits: each library's C per shape against its own at 1 thread"
for run in 1 2 4 8 16 avx2; do
  if [[ $run == avx2 ]]; then
    SHARDLAB_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=2 "$program" --bits 2 | sed 's/^/AVX2 at 2 threads\t/'
  else
    OMP_NUM_THREADS=$run "$program" --bits "$run" | sed "s/^/$run threads\t/"
  fi
done | python3 -c "
import collections, sys
bits = collections.defaultdict(dict)  # (library, shape) -> run -> hash
for line in sys.stdin:
    run, library, shape, digest = line.rstrip('\n').split('\t')
    bits[library, shape][run] = digest
for library in dict.fromkeys(library for library, _ in bits):
    shapes = [shape for lib, shape in bits if lib == library]
    changed = []
    for shape in shapes:
        runs = bits[library, shape]
        differ = [run for run, digest in runs.items() if digest != runs['1 threads']]
        if differ:
            changed.append(f'{shape} ({\", \".join(differ)})')
    same = len(shapes) - len(changed)
    print(f'{library}: the 1-thread bits in every run on {same} of {len(shapes)} shapes' +
          ('' if not changed else '; other bits on ' + '; '.join(changed)))
"
