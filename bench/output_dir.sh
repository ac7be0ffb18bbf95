# bench/output_dir.sh: sourced by the bench scripts: sets `out`, the folder for their raw output:
# $RESULTS_DIR when given (kept), else a temporary folder removed when the script exits.
if [ -n "${RESULTS_DIR:-}" ]; then
  out="$RESULTS_DIR"
  mkdir -p "$out"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
