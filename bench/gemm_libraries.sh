#!/usr/bin/env bash
# bench/gemm_libraries.sh: the Llama benchmark's GEMMs on shardlab's GEMM, BLIS 0.9 and oneDNN 2.6
# (Debian 12's libblis-dev and libdnnl-dev, installed here if missing), at THREADS threads (default 2),
# and torch.mm's column when the peers' environment exists (scripts/peers). Needs the build of
# shardlab's core (scripts/build). Prints the table; nothing of it enters shardlab's build.
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
