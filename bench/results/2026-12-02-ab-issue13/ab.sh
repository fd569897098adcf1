#!/usr/bin/env bash
# Same-run A/B: the pre-issue commit (wt-base, 22a11df) against main, alternating.
set -u
run() {  # tree label parts
  local dir=$1 label=$2 parts=$3
  local before; before=$(ls -t $dir/bench/results/*.json 2>/dev/null | head -1)
  echo "$(date +%T) $label $parts" >> /work/ab/log
  (cd $dir && .venv/bin/python bench/run --only "$parts") > /work/ab/$label.md 2> /work/ab/$label.err
  echo "$(date +%T) rc=$? $label" >> /work/ab/log
  local after; after=$(ls -t $dir/bench/results/*.json | head -1)
  cp "$after" /work/ab/$label.json
}
for round in 1 2; do
  run /work/wt-base base-$round-basic warm,create,exec,throughput,concurrent
  run /work/main main-$round-basic warm,create,exec,throughput,concurrent
done
run /work/wt-base base-life pause_resume,fork,suspend_restore
run /work/main main-life pause_resume,fork,suspend_restore
run /work/wt-base base-gw gateway
run /work/main main-gw gateway
run /work/wt-base base-e2b e2b
run /work/main main-e2b e2b
echo "$(date +%T) done" >> /work/ab/log
