#!/bin/bash
# Per-workflow, per-level e2e figures (issue 37): for each workflow a fresh `onepiece up` on its tiny model
# (the Redis path, as the earlier records), then `bench e2e` at lossless and at high against it, one after the
# other on the same deployment. Steps as benchmarks/quality.md's denoise-only figures: 28, schnell 16 (its
# tiny folder's limit). Round 1: lossless then high; round 2 (ROUND=2): high then lossless, files *-2.json; round 3 (ROUND=3
# SPECS="qwen-image:28 wan2.1-t2v:28"): lossless then high again for the two whose rounds both collapsed.
cd "$(dirname "$0")/../../.." || exit 1
OUT=benchmarks/e2e/2026-12-07-quality
STATE=${STATE:-/var/tmp/q37_state}
ROUND=${ROUND:-1}
case $ROUND in 1) LEVELS="lossless high"; SUF="";; 2) LEVELS="high lossless"; SUF="-2";; *) LEVELS="lossless high"; SUF="-$ROUND";; esac
for spec in ${SPECS:-flux.1-dev:28 flux.1-schnell:16 qwen-image:28 wan2.1-t2v:28}; do
  wf=${spec%%:*}; steps=${spec##*:}
  rm -rf "$STATE"
  setsid .venv/bin/onepiece up --state-dir "$STATE" --workflows "$wf" --object-store none > "$OUT/up-$wf$SUF.log" 2>&1 &
  UP=$!
  for i in $(seq 400); do grep -q "^ready" "$OUT/up-$wf$SUF.log" && break; sleep 1; done
  sleep 10  # the Node Manager's first capacity publication and the workers' warm-up settle
  PROXY=$(grep -o "proxy: http://[0-9.:]*" "$OUT/up-$wf$SUF.log" | cut -d' ' -f2)
  for q in $LEVELS; do
    echo "$(date -u +%T) $wf $q load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout 900 .venv/bin/onepiece bench e2e --proxy "$PROXY" --model-dir "$STATE/models/$wf" --state "$STATE" \
      --workflow "$wf" --quality "$q" --steps "$steps" --seconds 8 --requests 4 --json --no-mixed --no-stream \
      --no-single-stage --loads 1 --batches 4 > "$OUT/$wf-$q$SUF.json" 2> "$OUT/$wf-$q$SUF.err"
  done
  kill -INT "$UP"; wait "$UP"
  rm -rf "$STATE.$wf"; mv "$STATE" "$STATE.$wf"  # its logs kept for the stage times
done
echo "$(date -u +%T) done load $(cut -d' ' -f1-3 /proc/loadavg)"
