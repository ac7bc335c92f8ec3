#!/bin/bash
# `make gpu-check`: the CUDA checks of docs/speed.md in one call of at most 10 minutes, on a machine with one GPU and
# PyTorch (with CUDA) installed, from the repository root. Nothing is installed system-wide: the wheels of what the
# machine lacks (pytorch-optimizer) are read from $WHEELS (default .whl/) into /tmp/site; qlbench runs from this
# checkout. Logs and the bench report go into one folder, $GPU_CHECK_OUT (default gpu-check), with summary.txt: each
# part's exit code and wall time as a whole process; the records (with the pretrained backbones' cache, hundreds of MB
# at the paper budget) into $GPU_CHECK_RESULTS (default gpu-check-results), so that the log folder stays small enough
# to bring back. Each part has its own time limit (seconds, below), so a part that runs long is stopped and said so,
# and the parts after it still run; at the end the last lines of every part that did not exit 0 are printed.
# GPU_CHECK_PARTS (default, in this order: run-quick bench-deep-narrow compiled-exit test-cuda; at most 550 s) runs
# only the parts it names, e.g. GPU_CHECK_PARTS="test-cuda run-quick" for a functional check in a shorter call.
# The other parts, for further calls: peft-cuda (at most 150 s: peft's tuners, stacked and looped, on both
# backbones, and their members bench rows); bench-transformer (at most 250 s; 155 s did not reach its last row and estimate
# on an H200); wide-at-once (at most 250 s): the quick sweep of every function
# at the paper's stack width (five seeds: 45 members per method), the nine trained methods one at a time and then all
# at once (--methods-at-once, each its own thread and CUDA stream), their records compared; run-one-at-a-time (85 s):
# the quick run again with one method at a time (run-quick trains them all at once, the default on CUDA for
# deep-narrow), its records compared with run-quick's (the first call's, or run-quick in the same call);
# paper-deep-narrow and paper-transformer (35 and 45 s): a paper-budget LoRA cell on each
# backbone, compiled and captured as the paper budget runs on CUDA, stopped at its limit (its log shows the rate and
# the ETA); bench-compiled (at most 240 s): LoRA's and Queryable LoRA's steps compiled + captured (what the paper
# budget runs on CUDA) at E = 5 and 45; paper-table (at most 575 s, a call of its own): the deep-narrow paper table
# itself, its report, every seed's numbers and its records brought back (docs/speed.md gives the call's command).
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a process that crashes in native code prints every thread's Python stack first
OUT=${GPU_CHECK_OUT:-gpu-check}
RES=${GPU_CHECK_RESULTS:-gpu-check-results}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}  # the Python that holds PyTorch with CUDA
if ! $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "gpu-check: $PY has no PyTorch with a CUDA device; run it on a machine with a GPU (PYTHON=... to choose)" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 1
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# the function cards, where an installed qlbench has them (pyproject.toml maps functions/ into the package)
if [ ! -e qlbench/functions ]; then ln -s ../functions qlbench/functions; trap 'rm -f qlbench/functions' EXIT; fi
Q="$PY -c 'from qlbench.cli import entry; entry()'"  # as the `qlbench` console script runs
S=$OUT/summary.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())'
  git rev-parse HEAD 2>/dev/null || echo "not a git checkout: the records written here name no commit"
} > "$S" 2>&1
PARTS=" ${GPU_CHECK_PARTS:-run-quick bench-deep-narrow compiled-exit test-cuda} "  # the default: the header's list
part() {  # part NAME LIMIT COMMAND...: run COMMAND as a whole process under LIMIT seconds, log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [[ $PARTS == *" $name "* ]] || return 0
  local start=$(date +%s%N)
  timeout -k 10 "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
  local rc=$? wall=$(( ($(date +%s%N) - start) / 1000000 ))
  local note=""; [ $rc -eq 124 ] || [ $rc -eq 137 ] && note=" (stopped at its limit of $limit s: not finished)"
  printf '%-18s rc=%-3s wall=%4d.%01d s, ended %s%s\n' "$name" "$rc" $((wall / 1000)) $((wall % 1000 / 100)) \
    "$(date -u +%T.%N | cut -c1-12)" "$note" >> "$S"
}
# the timed parts first, alone on the device; the paper cells show their progress (steps/s, ETA) in their logs
part run-quick 80 "$Q run --function dropwave --arch deep-narrow --budget quick --device cuda --no-progress --out $RES && $PY docs/gpu/stage-times.py $RES"
# the same run one method at a time (run-quick's default trains its 11 methods at once on CUDA), in a results folder
# of its own (the records of run-quick would be reused), then every record against run-quick's (in the second call,
# run-quick's records are there from the first)
part run-one-at-a-time 85 "$Q run --function dropwave --arch deep-narrow --budget quick --device cuda --methods-at-once 1 --no-progress --out $RES-one && $PY docs/gpu/same-records.py $RES $RES-one"
# the paper-table estimate of every default method, one backbone per part (each part's report is written whole when
# it ends; a part stopped at its limit leaves the rows measured so far in bench.partial.json): its training step
# captured at E = 5 and at the paper's 45 (over whole periods of full-soap's eigenbases' refresh), kernels per step,
# evaluation time, and, on deep-narrow, every method's stack at once on its own stream (at_once; the Transformer's
# steps at 45 members are bound by their arithmetic, and with at_once its part did not reach its last rows in 165 s)
# and full-soap's optimiser step with its refresh timed alone (soap)
M=$($PY -c 'from qlbench import adapters; print(",".join(m for m in adapters.DEFAULT_METHODS if adapters.get(m).trains))')
part bench-deep-narrow 95 "$Q bench --quick --device cuda --archs deep-narrow --methods $M --only throughput,capture,at_once,soap --no-progress --out $OUT/bench-deep-narrow"
# the bench that crashed at its exit on CUDA (`bench --compile on`: "free(): invalid pointer", then a segmentation
# fault in the final garbage collection), as a process of its own: the times its report was written and its process
# ended (the summary's line and the report's time), and, 20 s before the part's limit, every thread's Python stack
# (faulthandler), so that a process that has not ended by then says where it waits; through `cli.entry`, as the
# `qlbench` script runs, which leaves a CUDA process by os._exit after `release`; tests/test_cuda.py runs the same
# command (deselected from test-cuda below)
QX="$PY -c 'import faulthandler; faulthandler.dump_traceback_later(150); from qlbench.cli import entry; entry()'"
part compiled-exit 170 "$QX bench --quick --compile on --device cuda --archs deep-narrow --methods lora,queryable --only capture --no-progress --out $OUT/compiled-exit"
[[ $PARTS == *" compiled-exit "* ]] && ls --full-time "$OUT/compiled-exit/bench.json" >> "$S" 2>&1
part bench-transformer 250 "$Q bench --quick --device cuda --archs transformer --methods $M --only throughput,capture --no-progress --out $OUT/bench-transformer"
# methods at once at the paper's stack width, where the quick run (3 members, faster at once) and the bench's at_once
# row (45 members, slower at once) disagreed (docs/speed.md): the quick sweep of the nine functions with five seeds,
# every trained method a stack of 45 as in the paper table (2,800 steps each; the paper budget's 35,000 would take
# about 10 minutes one at a time), captured, one at a time and then all at once, each process printing its wall time;
# then their records compared
W="sweep --arch deep-narrow --budget quick --seeds 5 --methods $M --device cuda --no-progress"
part wide-at-once 250 "$Q $W --methods-at-once 1 --out $RES-wide && $Q $W --methods-at-once 9 --out $RES-wide-at-once && $PY docs/gpu/same-records.py $RES-wide $RES-wide-at-once && $PY docs/gpu/stage-times.py $RES-wide && $PY docs/gpu/stage-times.py $RES-wide-at-once"
# the paper budget's own training step on CUDA (compiled + captured) against captured eager, for the method pair
# whose step ratio is a target, on both backbones; not in the default call
part bench-compiled 240 "$Q bench --quick --compile on --device cuda --methods lora,queryable --only throughput,capture --no-progress --out $OUT/bench-compiled"
part paper-deep-narrow 35 "$Q run --function dropwave --arch deep-narrow --budget paper --methods lora --device cuda --out $RES"
part paper-transformer 45 "$Q run --function dropwave --arch transformer --budget paper --methods lora --device cuda --out $RES"
# peft's tuners on CUDA (adapters/peft_tuners.py; not in the default call): a smoke run of stacked (vmap) and looped
# tuners beside qlbench's lora on both backbones, and the bench's members rows (stacked against looped) for three
PT="peft:lora,peft:vera,peft:boft,peft:ia3,peft:loha,peft:oft,peft:fourierft"
part peft-cuda 150 "$Q run --function matyas --arch deep-narrow --budget smoke --methods lora,$PT --device cuda --no-progress --out $RES-peft && $Q run --function matyas --arch transformer --budget smoke --methods lora,peft:lora,peft:loha --device cuda --no-progress --out $RES-peft && $Q bench --quick --device cuda --archs deep-narrow --methods peft:lora,peft:vera,peft:ia3 --only members --no-progress --out $OUT/bench-members"
# the deep-narrow paper table itself (9 functions x 5 seeds x every default method, 5,000 epochs, every method's
# stack of 45 at once, the default there), timed as a whole process: the 10-minute target measured, not estimated.
# The sweep stops at GPU_CHECK_PAPER_S seconds, 505 unless set (its progress line in the log gives the rate and the
# time left; the same call again on the held machine skips finished cells and resumes each stopped stack from its last
# snapshot, with GPU_CHECK_PAPER_S set to fit the device time left); then whatever finished is
# reported there (`qlbench report`, tables and statistics, no figures), every seed's numbers go into one small CSV
# (docs/gpu/per-seed.py), and the records (without the adapters' weights) into 15 MiB pieces
# paper-records.tgz.00, .01, ... when they come to at most 45 MiB: a call brings back at most 8 files of 16 MiB, 64 MiB
# in all, so the pieces are moved to the call's own folder beside the tarred logs (docs/speed.md gives the call)
PAPER_S=${GPU_CHECK_PAPER_S:-505}  # the sweep's limit; the part's is 70 s more, for its report and packing
QT="timeout -k 5 $PAPER_S $Q"
P="sweep --arch deep-narrow --budget paper --device cuda --snapshot-every 30 --out $RES-paper"
part paper-table $((PAPER_S + 70)) "$QT $P; rc=\$?; $PY docs/gpu/stage-times.py $RES-paper; $Q report $RES-paper --budget paper --format md,csv --no-figures --out $OUT/paper-report; $PY docs/gpu/per-seed.py $RES-paper $OUT/paper-per-seed.csv; tar czf $OUT/paper-records.tgz --exclude='*.pt' -C $RES-paper records && if [ \$(stat -c %s $OUT/paper-records.tgz) -le 47185920 ]; then split -b 15M -d $OUT/paper-records.tgz $OUT/paper-records.tgz.; else echo paper-records.tgz: over 45 MiB, not brought back; fi; rm -f $OUT/paper-records.tgz; [ \$rc -eq 124 ] && echo the sweep stopped at its $PAPER_S s: not finished; exit \$rc"
# then the CUDA tests (not timed; the compiled bench's exit is the part compiled-exit above): on 8 processes where pytest-xdist is installed, each test's outcome on its own
# line as it ends (-v), and each test under 140 s where pytest-timeout is, so the failures' reasons are printed before
# the part's own limit (the thread method: it prints every thread's stack, even when the test waits in C code, where
# the signal method waits for it); and each failure's traceback as it happens (tests/conftest.py)
XDIST=""; $PY -c 'import xdist' 2>/dev/null && XDIST="-n 8"
PER_TEST=""; $PY -c 'import pytest_timeout' 2>/dev/null && PER_TEST="--timeout 140 --timeout-method thread"
part test-cuda 200 "QLBENCH_FAILURES_AT_ONCE=1 $PY -m pytest -v -m cuda -rs -p no:cacheprovider tests/test_cuda.py $XDIST $PER_TEST --durations=0 -k 'not exits_cleanly'"
cat "$S"
for log in "$OUT"/*.log; do  # why a part failed, in the call's own output (progress lines left out)
  name=$(basename "$log" .log)
  grep -q "^$name .*rc=0 " "$S" && continue
  echo "--- $name: last lines"; grep -v -E "steps \(|^\s*$|Warning|warn" "$log" | tail -n 15
done
