#!/usr/bin/env bash
# kahan's exactness on this machine's GPU, as one call (under 5 minutes on an
# H200-class machine; the 2026-12-04 H200 run lost every kahan residual):
#   1. the known-answer check users run (ok.known_answer_check, seconds);
#   2. kahan's teacher-forced corpus, its own tests and the check's tests;
#   3. the diagnosis (benchmarks/exactness.py): for the program as users run
#      it, with command buffers off, and with each residual's split in a
#      fusion of its own, which part and leaf differ from the CPU's.
# Everything printed is saved under benchmarks/results/gpu_<date>_<device>/,
# with the versions and the device. Exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
device=$(python3 -c "import jax, re; \
print(re.sub('[^A-Za-z0-9]+', '_', jax.devices()[0].device_kind).strip('_'))")
out="benchmarks/results/gpu_$(date +%F)_$device"
mkdir -p "$out"
python3 -c "import sys, jax, jaxlib, optax, flax; print('Python', \
sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', \
jaxlib.__version__, '| optax', optax.__version__, '| flax', flax.__version__, \
'|', jax.devices())" | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
  >> "$out/versions.txt" 2>&1 || true
status=0
timeout 120 python3 -c "import optax_kahan as ok; ok.known_answer_check()" \
  2>&1 | tee "$out/known_answer.txt" || status=1
timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -q \
  -m "not slow" tests/test_known_answer.py tests/test_kahan.py \
  tests/test_same_answer.py 2>&1 | tail -40 | tee "$out/tests.txt" || status=1
timeout 600 python3 -m benchmarks.exactness --hlo-dir "$out/hlo" \
  --out "$out/exactness.txt" 2>&1 | tail -40 || status=1
exit $status
