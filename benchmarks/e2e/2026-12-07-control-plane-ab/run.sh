#!/bin/bash
# A/B of the control plane: A = 0cd7362 (last session's end, in a worktree), B = HEAD; each a fresh onepiece up
cd /work/main
for cfg in A B A B; do
  rm -rf /var/tmp/ab_state
  if [ $cfg = A ]; then export PYTHONPATH=/var/tmp/wt_a; else unset PYTHONPATH; fi
  setsid .venv/bin/onepiece up --state-dir /var/tmp/ab_state --workflows sd-t2i --object-store none > /var/tmp/ab2_up_$cfg.log 2>&1 &
  for i in $(seq 120); do grep -q "^ready" /var/tmp/ab2_up_$cfg.log && break; sleep 1; done
  sleep 10
  PROXY=$(grep -o "proxy: http://[0-9.:]*" /var/tmp/ab2_up_$cfg.log | cut -d' ' -f2)
  timeout 600 .venv/bin/onepiece bench e2e --proxy $PROXY --model-dir /var/tmp/ab_state/models/sd-t2i --state /var/tmp/ab_state --seconds 10 --requests 4 --json --no-mixed --no-stream --no-single-stage --loads 1 --batches 8 > /var/tmp/ab2_$cfg.$RANDOM.json 2>/var/tmp/ab2_err_$cfg.log
  pkill -INT -f "onepiece up --state-dir /var/tmp/ab_state"; sleep 15
done
echo done
