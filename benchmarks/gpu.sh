#!/usr/bin/env bash
# The GPU checks and benchmarks, in one go (the H200 run of 2026-12-04 was cut
# off in the streaming part; the batch-8 run comes last):
#   0. kahan's exactness on this GPU (benchmarks/gpu_exactness.sh: the
#      known-answer check, its tests, the diagnosis benchmarks/exactness.py);
#   1. the optimizer-step speed ratios (benchmarks/speed.py, 46M params);
#   2. a full training step of the example's UNet (58M params): Kahan with host
#      offload against plain bf16, step-time ratio, device/host bytes from
#      compiled.memory_analysis() and the peak device memory of each setup;
#      then the DiT-like model's step, scanned and unrolled, host residuals
#      against offload=False;
#   3. the blockwise FLUX.1-dev step at 4 + 8 blocks (benchmarks/stream_gpu.py):
#      residuals on the device, in host memory, in host memory but half the
#      double blocks' (residuals_on_device), every block streamed, and that
#      with the activations in host memory;
#      measured peak and step-time ratios against the compiled peak and the
#      timeline model; then at batch 8, residuals on the device against every
#      block streamed with the activations in host memory (the README's 16 GB
#      row at reduced depth).
# Needs jax with its GPU plugin, optax, flax, chex and scikit-learn installed;
# the package is used from this checkout, and nothing is downloaded.
# Results land in benchmarks/results/{speed,gpu_step,gpu_step_dit-scanned,
# gpu_step_dit-unrolled,stream_gpu,stream_gpu_b8}.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # so that peak_bytes_in_use is ours
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# 0. exactness on this GPU first (on the 2026-12-04 H200 run every kahan case
#    lost its residuals): the known-answer check, kahan's tests and the
#    diagnosis, logged under benchmarks/results/gpu_<date>_<device>/
bash benchmarks/gpu_exactness.sh || true
python3 -m benchmarks.speed --reps 30
python3 -m benchmarks.gpu_step --width 384 --batch 256 --reps 30
# the DiT-like whole step (151M params, block remat), scanned and unrolled:
# host residuals against offload=False, measured (the compiled tables: scanned
# 1.94 B/param lower; unrolled higher)
python3 -m benchmarks.gpu_step --model dit-scanned --reps 20
python3 -m benchmarks.gpu_step --model dit-unrolled --reps 20
if [ -f benchmarks/step_memory.py ]; then python3 -m benchmarks.step_memory; fi
# the streaming FLUX step (4 + 8 blocks), measured against the model
python3 -m benchmarks.stream_gpu --steps 5
python3 -m benchmarks.stream_gpu --steps 3 --batch 8 \
  --only "residuals on the device" --only "all blocks streamed, activations on host"
