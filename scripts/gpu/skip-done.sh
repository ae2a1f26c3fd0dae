# GPU host, sourced with NAME (the matrix's name) set: SKIP_DONE becomes the runs.jsonl files whose runs the runner
# leaves out (--skip-done), blank for none. SKIP_DONE as given: files of earlier calls carried into the checkout;
# SKIP_HOST=1 adds the runs.jsonl of earlier calls of this matrix on this host (scripts/gpu/host-runs.sh), so a call
# sent in one batch right after another continues it (a fresh host has none: nothing is left out there).
if [ "${SKIP_HOST:-}" = 1 ]; then
  KEPT=$(bash scripts/gpu/host-runs.sh list "$NAME" | tr '\n' ' ')
  echo "SKIP_HOST: earlier calls of $NAME on this host: ${KEPT:-none}"
  SKIP_DONE="${SKIP_DONE:-} $KEPT"
fi
SKIP_DONE=$(echo ${SKIP_DONE:-})   # globs expand here, on the host
