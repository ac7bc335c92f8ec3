#!/bin/bash
# The CUDA probe of docs/speed.md: run from the repository root on a machine with one GPU and PyTorch, with the
# wheels of what it lacks (pytorch-optimizer) in .whl/; logs in $OUT (default gpu-probe-logs).
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-probe-logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# qlbench from this checkout, its function cards where the installed package has them (removed on exit)
export PYTHONPATH=/tmp/site:$PWD
if [ ! -e qlbench/functions ]; then ln -s ../functions qlbench/functions; trap 'rm -f qlbench/functions' EXIT; fi
L=$OUT/probe.log
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; } >> $L 2>&1
run() { echo "== $* (limit $1 s)" >> $L; start=$(date +%s%N); timeout -k 5 "$@" >> $L 2>&1; rc=$?; echo "rc=$rc wall=$(( ($(date +%s%N) - start) / 1000000 )) ms" >> $L; }
run 70 python3 docs/gpu/probe.py compile dora reduce-overhead
run 70 python3 docs/gpu/probe.py compile lora reduce-overhead
run 70 python3 docs/gpu/probe.py compile dora default
for m in lora queryable dora; do for E in 5 45; do run 45 python3 docs/gpu/probe.py capture $m $E; done; done
run 70 python3 docs/gpu/probe.py compile dora max-autotune-no-cudagraphs
grep -v "^\s*$" $L | tail -c 11000
