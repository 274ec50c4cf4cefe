#!/usr/bin/env bash
# The GPU check on a GPU machine lent for minutes, run from a copy of the repository that
# carries the pack (target/gpu-pack/cellc-gpu.tar.gz, made here by tests/gpu/pack.sh):
#
#     tests/gpu/lent.sh RESULTS_DIR [BUDGET_SECONDS] [--resume | --grid-from EARLIER_RESULTS_JSON]
#
# --grid-from (a committed benches/results/gpu_check_*.json): every step runs, and the speed
# step goes on with the rows that check lacks, carrying its rows (check.py's --grid-from), so
# that a grid longer than one session's device time is measured over several sessions.
#
# The check works in a folder that outlives the call on that machine ($CELLC_GPU_CHECK_DIR,
# default target/gpu-check in the copy of the repository, which git ignores and a second call
# on the same machine finds again), so that a second call with --resume goes on where the first
# stopped; where the machine is a fresh one, a results.json carried in the repository at
# target/gpu-pack/results.json (the first call's, copied back) seeds it. Each call ends by
# copying three files into RESULTS_DIR: results.json, summary.md and logs.tar.gz.
# BUDGET_SECONDS defaults to 540: one 10-minute call with room to unpack and copy.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${1:?usage: tests/gpu/lent.sh RESULTS_DIR [BUDGET_SECONDS] [--resume | --grid-from EARLIER_RESULTS_JSON]}"
BUDGET="${2:-540}"
RESUME="${3:-}"
GRID_FROM=()
if [ "$RESUME" = "--grid-from" ]; then
    GRID_FROM=(--grid-from "${4:?--grid-from needs the results.json of an earlier check}")
    RESUME=""
fi
WORK="${CELLC_GPU_CHECK_DIR:-target/gpu-check}"
PACK=target/gpu-pack/cellc-gpu.tar.gz
mkdir -p "$WORK" "$RESULTS"
if [ "$RESUME" = "--resume" ] && [ ! -f "$WORK/results.json" ] && [ -f target/gpu-pack/results.json ]; then
    cp target/gpu-pack/results.json "$WORK/results.json"
fi
PYTHONUNBUFFERED=1 python3 tests/gpu/check.py --pack "$PACK" --out "$WORK" --budget "$BUDGET" $RESUME "${GRID_FROM[@]}"
status=$?
cp "$WORK/results.json" "$WORK/summary.md" "$RESULTS/" 2>/dev/null
tar -czf "$RESULTS/logs.tar.gz" -C "$WORK" logs 2>/dev/null
exit $status
