#!/usr/bin/env bash
# The CUDA checks, as one command for a lent GPU machine (see docs/gpu.md): the launched run's CUDA telemetry,
# bf16 autocast and CUDA RNG resume (benchmarks/gpu_paths.py), planned vs measured peak memory of a ~1B model under
# every checkpointing mode (benchmarks/memory_calibration.py; through a launched run: launched_memory.py; Hugging Face
# models: gpu_hf_memory.sh), context-parallel attention on the CUDA kernels
# (benchmarks/cp_cpu_probe.py --device cuda). Uses the machine's own torch; jupyter_dist from this checkout.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
echo "### gpu_paths"; timeout 240 python3 benchmarks/gpu_paths.py --out "$OUT"; echo "rc=$?"
echo "### memory_calibration"; timeout 180 python3 benchmarks/memory_calibration.py --gpu "${GPU_NAME:-h100-80gb}"; echo "rc=$?"
for dt in bf16 fp32; do
  echo "### cp $dt"; timeout 90 python3 benchmarks/cp_cpu_probe.py --device cuda --dtype $dt --seq 8192 --heads 16 --head-dim 128 --batch 1; echo "rc=$?"
done
echo "### launched"; timeout 400 python3 benchmarks/launched_memory.py --gpu "${GPU_NAME:-h100-80gb}" \
    --modes none,selective,op,layer:2,full; echo "rc=$?"
echo "### hf"; bash scripts/gpu_hf_memory.sh
