#!/usr/bin/env bash
# Real weights and whole commands (`-m slow`): SmolLM2-135M and Gemma-3-270M against stock,
# the Gemma-3 Trainer step's memory, the CLI's demo and doctor, every example and every README /
# docs snippet, the parity sweep's test. Runs in README's .venv (made by README's test command,
# which .ci/run runs first; made here when absent). First run: dequantising both GGUF files
# takes 1-3 minutes more (cached in ~/.cache/fused_ce_patch).
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/venv.sh
export OMP_NUM_THREADS=1
python -m pytest -q -n 2 --dist loadscope -m "slow and not distributed"
