# bench/output_dir.sh: sourced by the bench scripts: sets `out`, the folder for their raw output:
# $OUT when given (kept), else a temporary folder removed when the script exits.
if [ -n "${OUT:-}" ]; then
  out="$OUT"
  mkdir -p "$out"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
