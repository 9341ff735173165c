#!/bin/bash
# A/B of this session's request-path changes (options in the header and on the job, lazy executor imports,
# executor declarations): A = 7c25016 (the session's start, a git worktree with the built ring extension
# copied in, first on PYTHONPATH), B = HEAD; each a fresh onepiece up and a short bench, A, B, A, B.
cd /work/main
OUT=benchmarks/e2e/2026-12-07-options-ab
for cfg in A B A B; do
  rm -rf /var/tmp/ab_state
  if [ $cfg = A ]; then export PYTHONPATH=/var/tmp/wt_a; else unset PYTHONPATH; fi
  setsid .venv/bin/onepiece up --state-dir /var/tmp/ab_state --workflows sd-t2i --object-store none > /var/tmp/ab_up_$cfg.log 2>&1 &
  for i in $(seq 180); do grep -q "^ready" /var/tmp/ab_up_$cfg.log && break; sleep 1; done
  sleep 10
  PROXY=$(grep -o "proxy: http://[0-9.:]*" /var/tmp/ab_up_$cfg.log | cut -d' ' -f2)
  timeout 600 .venv/bin/onepiece bench e2e --proxy $PROXY --model-dir /var/tmp/ab_state/models/sd-t2i --state /var/tmp/ab_state --seconds 10 --requests 4 --json --no-mixed --no-stream --no-single-stage --loads 1 --batches 8 > $OUT/$cfg.$(date +%H%M%S).json 2>/var/tmp/ab_err_$cfg.log
  pkill -INT -f "onepiece up --state-dir /var/tmp/ab_state"; sleep 15
done
echo done
