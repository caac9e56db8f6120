"""TRL's module attributes come back when the last patched model goes away, revert or not.

``apply_fused_ce`` replaces ``trl.trainer.utils._ChunkedLogProbFunction`` (and, on older TRL,
``sft_trainer._chunked_cross_entropy_loss``) by a router while some model is patched
(fused_ce_patch/hf/trl.py). These tests delete patched models without ``revert_fused_ce`` and
check, by identity, that TRL holds its own objects again — and not before the last one is gone.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys

import pytest

trl = pytest.importorskip("trl", reason="TRL is optional; install trl to run this test")
import trl.trainer.utils  # noqa: E402,F401  the module whose attribute is routed

from fused_ce_patch import apply_fused_ce, revert_fused_ce  # noqa: E402
from fused_ce_patch.hf import trl as trl_routing  # noqa: E402
from hf_helpers import build_model  # noqa: E402


def _targets():
    """``{(module, attr): object}`` of the TRL attributes fused_ce_patch routes, as they are."""
    found = {}
    for module_name, attr, _ in trl_routing._TARGETS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            found[(module_name, attr)] = getattr(module, attr)
    return found


@pytest.fixture
def originals():
    revert_fused_ce()
    before = _targets()
    assert before, "this TRL has none of the routed attributes"
    yield before
    revert_fused_ce()
    gc.collect()
    assert _targets() == before


def _same(now, before):
    return now.keys() == before.keys() and all(now[k] is before[k] for k in before)


def test_garbage_collected_model_gives_trl_its_objects_back(originals):
    model = apply_fused_ce(build_model("llama"))
    assert not _same(_targets(), originals)  # routed while patched
    del model
    gc.collect()
    assert _same(_targets(), originals)
    assert not trl_routing.is_installed()


def test_routing_stays_until_the_last_patched_model_is_gone(originals):
    a = apply_fused_ce(build_model("llama"))
    b = apply_fused_ce(build_model("qwen2"))
    del a
    gc.collect()
    assert not _same(_targets(), originals)  # b still patched: routed
    del b
    gc.collect()
    assert _same(_targets(), originals)


def test_deep_copy_keeps_routing_after_the_original_dies(originals):
    a = apply_fused_ce(build_model("llama"))
    clone = copy.deepcopy(a)  # patched and tracked too, made after install()
    del a
    gc.collect()
    assert not _same(_targets(), originals)
    del clone
    gc.collect()
    assert _same(_targets(), originals)


def test_reverted_then_collected_and_repatched(originals):
    a = apply_fused_ce(build_model("llama"))
    revert_fused_ce(a)
    assert _same(_targets(), originals)
    b = apply_fused_ce(build_model("llama"))
    del a  # its finalizer runs while b is patched: routing must stay
    gc.collect()
    assert not _same(_targets(), originals)
    del b
    gc.collect()
    assert _same(_targets(), originals)


def test_model_in_a_reference_cycle(originals):
    model = apply_fused_ce(build_model("llama"))
    model.cycle = [model]  # only the cyclic collector can free it
    del model
    gc.collect()
    assert _same(_targets(), originals)


def test_interpreter_exit_with_a_live_patched_model_is_clean():
    code = (
        "import trl.trainer.utils, sys\n"
        "sys.path.insert(0, 'tests/hf')\n"
        "from hf_helpers import build_model\n"
        "from fused_ce_patch import apply_fused_ce\n"
        "m = apply_fused_ce(build_model('llama'))\n"
        "m.cycle = [m]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
