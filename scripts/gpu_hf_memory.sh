#!/usr/bin/env bash
# Planned against measured peak memory of Hugging Face models built from their config.json (offline, random weights)
# under every checkpointing mode, on a lent GPU (docs/gpu.md). Uses the machine's own torch; jupyter_dist from this
# checkout. Without transformers on that machine, unpacks the wheels in $WHEELS (default .gpu-wheels: made here with
#   pip download transformers==5.17.0 --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu-wheels
# and carried to the machine) into a folder put on PYTHONPATH, keeping the machine's own copies of what it has.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
extra=""
if ! python3 -c "import transformers" 2>/dev/null; then
    WHEELS=${WHEELS:-.gpu-wheels}
    extra=$(mktemp -d /tmp/jd-hf.XXXXXX)
    for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" "$extra"; done
    for m in numpy typing_extensions filelock fsspec packaging yaml tqdm; do  # keep what the machine's torch uses
        if python3 -c "import $m" 2>/dev/null; then rm -rf "$extra/$m" "$extra/$m.py" "$extra"/"$m"-*.dist-info; fi
    done
fi
export PYTHONPATH=$PWD${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
for cfg in ${HF_CONFIGS:-llama-1.1b qwen3-1.7b}; do
    echo "### hf $cfg"
    timeout 300 python3 benchmarks/memory_calibration.py --gpu "${GPU_NAME:-h100-80gb}" \
        --hf-config "benchmarks/hf_configs/$cfg.json" --strategies "${STRATEGIES:-ddp,fsdp2,plain}" ${DETAIL:+--detail}
    echo "rc=$?"
done
