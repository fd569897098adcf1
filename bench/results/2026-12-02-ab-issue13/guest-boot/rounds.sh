#!/bin/bash
# alternate trees: base main base main ...
cd /work/probe
for r in 1 2 3 4; do
  for t in base main; do
    d=/work/main; [ $t = base ] && d=/work/wt-base
    (cd $d && .venv/bin/python /work/probe/bootprobe.py $d 15 /work/probe/r$r-$t.json) > /work/probe/r$r-$t.txt 2>&1
  done
done
echo ROUNDS_DONE > /work/probe/done
