# bench/prologue.sh: sourced by the bench scripts after `cd` to the repository's root. Sets
# `build_dir` (SHARDLAB_BUILD_DIR, else build/), `out`, the folder for their raw output
# ($RESULTS_DIR when given, kept; else a temporary folder removed when the script exits), and
# `mpirun`, the launcher with --oversubscribe (more ranks than cores on a small machine) and, as
# root only, --allow-run-as-root: run "${mpirun[@]}" -np N PROGRAM ...
build_dir="${SHARDLAB_BUILD_DIR:-build}"
if [ -n "${RESULTS_DIR:-}" ]; then
  out="$RESULTS_DIR"
  mkdir -p "$out"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
mpirun=(mpirun --oversubscribe)
if [ "$(id -u)" = 0 ]; then mpirun+=(--allow-run-as-root); fi
