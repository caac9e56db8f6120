#!/usr/bin/env bash
# Parity sweep matrix (CPU): the proof that apply_fused_ce runs before patching a class
# (fused_ce_patch/hf/proof.py), for every causal-LM type in transformers' registry, on the oldest
# supported transformers release, a middle one and the newest on the registry, in a venv of its
# own (.venv-sweep). Fails when a type that docs/support.json records as passing on that release
# fails now (a release the record does not hold is held to the newest recorded one before it).
# Called by .ci/run after the TRL matrix. Measured on the 2-core dev machine, shared with other
# jobs: about 3-4 minutes of sweep per release (full registry, 2 workers) plus installs.
# transformers' own modeling tests cannot run here: its sdist on the registry (checked: 5.17.0,
# 5.24.0) carries only tests/test_*_common.py and mixins, no tests/models/.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-sweep
. .venv-sweep/bin/activate
pip install -q torch==2.13.0  # the CPU build on local disk; a bare torch would pull CUDA
pip install -q -e . pillow einops  # the record was made with both (image processors, some mixers)
export OMP_NUM_THREADS=1
newest=$(pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
status=0
for version in 5.17.0 5.21.1 "${newest:-5.25.0}"; do
    # torch pinned: never swapped. A newest release whose dependencies the registry lacks
    # (5.25.0 needed kernels>=0.19.1, missing 2026-12-02) cannot be tested here: say so, use
    # the newest recorded one (5.25.0, recorded 2026-12-04).
    if ! pip install -q "transformers==$version" torch==2.13.0; then
        echo "+ transformers $version: not installable from the registry; sweeping 5.25.0 instead"
        version=5.25.0
        pip install -q "transformers==$version" torch==2.13.0
    fi
    echo "+ transformers $version: python -m fused_ce_patch.hf.sweep --check"
    start=$SECONDS
    python -m fused_ce_patch.hf.sweep --check || status=1
    echo "+ transformers $version: $((SECONDS - start)) s"
done
exit $status
