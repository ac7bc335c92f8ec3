#!/bin/bash
# `make gpu-check`: the CUDA checks of docs/speed.md in one call of at most 10 minutes, on a machine with one GPU and
# PyTorch (with CUDA) installed, from the repository root. Nothing is installed system-wide: the wheels of what the
# machine lacks (pytorch-optimizer) are read from $WHEELS (default .whl/) into /tmp/site; qlbench runs from this
# checkout. Logs, records and the bench report go into one folder, $GPU_CHECK_OUT (default gpu-check), with
# summary.txt: each part's exit code and wall time as a whole process. Each part has its own time limit (seconds,
# below), so a part that runs long is stopped and said so, and the parts after it still run.
export PYTHONUNBUFFERED=1
OUT=${GPU_CHECK_OUT:-gpu-check}
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
Q="$PY -c 'import sys; from qlbench.cli import main; sys.exit(main())'"
S=$OUT/summary.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())'
} > "$S" 2>&1
part() {  # part NAME LIMIT COMMAND...: run COMMAND as a whole process under LIMIT seconds, log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$(date +%s%N)
  timeout -k 10 "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
  local rc=$? wall=$(( ($(date +%s%N) - start) / 1000000 ))
  local note=""; [ $rc -eq 124 ] || [ $rc -eq 137 ] && note=" (stopped at its limit of $limit s: not finished)"
  printf '%-18s rc=%-3s wall=%4d.%01d s%s\n' "$name" "$rc" $((wall / 1000)) $((wall % 1000 / 100)) "$note" >> "$S"
}
part test-cuda 270 "$PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_cuda.py --durations=0"
part run-quick 75 "$Q run --function dropwave --arch deep-narrow --budget quick --device cuda --no-progress --out $OUT/results"
part bench 75 "$Q bench --quick --device cuda --methods lora,queryable,dora --no-progress --out $OUT/bench"
part paper-deep-narrow 75 "$Q run --function dropwave --arch deep-narrow --budget paper --methods lora --device cuda --no-progress --out $OUT/results"
part paper-transformer 65 "$Q run --function dropwave --arch transformer --budget paper --methods lora --device cuda --no-progress --out $OUT/results"
cat "$S"
tail -n 25 "$OUT/test-cuda.log"
