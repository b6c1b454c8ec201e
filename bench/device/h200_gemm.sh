#!/bin/bash
# One device run for issue 40's measurements (GEMM, generation, commitment, Freivalds).
# Read-only towards the GPU's settings: nvidia-smi is only queried. Writes under $OUT (<= 8 files).
set -u
OUT=${OUT:?}
HERE=$(cd "$(dirname "$0")" && pwd)
exec > >(tee "$OUT/log.txt") 2>&1
date -u +%Y-%m-%dT%H:%M:%SZ; uname -r
PY=
for cand in python3 /opt/torch/.venv/bin/python3; do
  if timeout 60 $cand -c 'import torch' 2>/dev/null; then PY=$cand; break; fi
done
[ -n "$PY" ] || { echo "no python with torch; trying python3 anyway (h200_gemm.py records the import error)"; PY=python3; }
echo "python: $(command -v $PY) $($PY -V 2>&1)"
Q=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu
SAMPLE=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used,clocks_event_reasons.active
{ echo "# before $(date -u +%FT%T.%NZ)"; timeout 20 nvidia-smi --query-gpu=$Q --format=csv; timeout 20 nvidia-smi --version; } > "$OUT/smi.txt" 2>&1
timeout 10 nvidia-smi --query-gpu=$SAMPLE --format=csv >/dev/null 2>&1 || SAMPLE=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu,memory.used
nvidia-smi --query-gpu=$SAMPLE --format=csv -lms 500 > "$OUT/smi-samples.csv" 2>&1 &
SMPID=$!
PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-200} $PY "$HERE/h200_gemm.py"; echo "bench rc=$?"
{ echo "# after $(date -u +%FT%T.%NZ)"; timeout 20 nvidia-smi --query-gpu=$Q --format=csv; } >> "$OUT/smi.txt" 2>&1
kill $SMPID 2>/dev/null
cat "$OUT/smi.txt"
echo "samples: $(wc -l < "$OUT/smi-samples.csv")"; tail -3 "$OUT/smi-samples.csv"
ls -la "$OUT"; date -u +%Y-%m-%dT%H:%M:%SZ
