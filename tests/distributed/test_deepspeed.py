"""DeepSpeed ZeRO-2 / ZeRO-3 on CPU (``DS_ACCELERATOR=cpu``, gloo, 2 processes; on 2 GPUs with
NCCL under ``FUSED_CE_DIST_DEVICE=cuda``): through
accelerate's DeepSpeedPlugin and through ``deepspeed.initialize``; same checks as
test_distributed.py. ZeRO-3 partitions the head (checked), so the loss runs inside
``lm_head``'s call where ZeRO-3's hooks gather it. Skipped when deepspeed is not installed (CI's
distributed step, .ci/distributed.sh, installs it)."""

from __future__ import annotations

import os

import pytest

import dist_workers as w

if not w.CUDA:  # before deepspeed picks its accelerator; on GPUs it picks CUDA itself
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="needs the deepspeed package")
from test_distributed import check_mode, pytestmark, spawn  # noqa: E402, F401


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(tmp_path_factory, w.DEEPSPEED_MODES)


@pytest.mark.parametrize("mode", w.DEEPSPEED_MODES)
def test_zero_matches_single_process_stock(results, mode):
    check_mode(results, mode, "zero3" if "zero3" in mode else "plain")
