"""TRL's DistillationTrainer computes its generalized JSD with fused_linear_jsd once the
student is patched (the flag, or ``apply_fused_ce``), with TRL's own loss and entropy logs.

Stock and patched runs start from identical float32 weights with the same seed; a spy proves
fused_linear_jsd ran (and that stock never called it); the logged loss and entropy agree
within 1e-5 over the steps.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; install trl to run this test")
datasets = pytest.importorskip("datasets")
distillation_trainer = pytest.importorskip(
    "trl.trainer.distillation_trainer", reason="this TRL has no DistillationTrainer")
if not hasattr(distillation_trainer, "_chunked_divergence_loss"):
    pytest.skip("this TRL's DistillationTrainer has no _chunked_divergence_loss",
                allow_module_level=True)

from fused_ce_patch import FusedCECallback, apply_fused_ce, revert_fused_ce  # noqa: E402
from fused_ce_patch.hf import trl as trl_routing  # noqa: E402
from hf_helpers import build_model  # noqa: E402
from test_trl import _common, _history, _tokenizer  # noqa: E402

TOL = 1e-5
KEYS = ["loss", "entropy"]


def _model(seed, sharpness):
    """A tiny llama whose next-token distributions are far from uniform (its lm_head scaled:
    random tiny models are nearly uniform, which would make every divergence ~0)."""
    model = build_model("llama", seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model


def _student():
    return _model(0, 20.0)


def _teacher():
    return _model(1, 40.0).eval()


class _JsdSpy:
    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def jsd_spy(monkeypatch):
    import fused_ce_patch.distill as distill

    spy = _JsdSpy(distill.fused_linear_jsd)
    monkeypatch.setattr(distill, "fused_linear_jsd", spy)
    yield spy
    revert_fused_ce()


def _distill(student, teacher, tmp_path, beta, callbacks=()):
    extra = {"max_steps": 3, "max_completion_length": 4, "per_device_train_batch_size": 2,
             "beta": beta, "temperature": 1.5, "learning_rate": 0.5}
    args = trl.DistillationConfig(**{**_common(tmp_path), **extra})
    prompts = [{"prompt": "t5 t6 t7"}, {"prompt": "t8 t9"}, {"prompt": "t10 t11 t12 t13"},
               {"prompt": "t3 t4"}]
    torch.manual_seed(0)  # same sampled completions in both runs
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=datasets.Dataset.from_list(prompts),
                                      processing_class=_tokenizer(), callbacks=list(callbacks))
    trainer.train()
    return trainer


def _assert_same(got, want):
    for k in KEYS:
        assert k in want and k in got, k
        assert len(want[k]) >= 3, k
        assert want[k].abs().min() > 0.05, (k, want[k])  # a divergence far from 0
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=0.0, msg=k)


@pytest.mark.parametrize("route", ["flag", "apply_first"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_trains_with_fused_jsd_and_same_logs(route, beta, tmp_path, jsd_spy):
    teacher = _teacher()
    want = _history(_distill(_student(), teacher, tmp_path / "s", beta), KEYS)
    assert jsd_spy.count == 0
    assert len(set(want["loss"].tolist())) > 1, want  # the steps train
    student = _student()
    callbacks = []
    if route == "flag":
        callbacks = [FusedCECallback()]
    else:
        apply_fused_ce(student)
    trainer = _distill(student, teacher, tmp_path / "o", beta, callbacks)
    assert jsd_spy.count >= 3
    _assert_same(_history(trainer, KEYS), want)


def test_unpatched_student_keeps_trl_kernel(tmp_path, jsd_spy):
    other = apply_fused_ce(build_model("llama", seed=3))  # routing installed for another model
    assert trl_routing.is_installed()
    _distill(_student(), _teacher(), tmp_path, 0.5)
    assert jsd_spy.count == 0
    del other


def test_router_leaves_unusual_operands_to_trl(jsd_spy):
    student = apply_fused_ce(build_model("llama"))
    route = distillation_trainer._chunked_divergence_loss
    original = route.__wrapped__
    w = student.get_output_embeddings().weight
    h = torch.randn(1, 3, w.shape[1])
    mask = torch.ones(1, 3, dtype=torch.long)
    for kw in (dict(beta=1.5), dict(beta=0.5, temperature=0.0),
               dict(beta=0.5, student_final_logit_softcapping=-1.0)):
        beta = kw.pop("beta")
        try:
            want = original(h, h, w, w.detach(), mask, beta, **kw)
        except Exception as exc:  # noqa: BLE001 - then the router must raise the same
            with pytest.raises(type(exc)):
                route(h, h, w, w.detach(), mask, beta, **kw)
        else:
            got = route(h, h, w, w.detach(), mask, beta, **kw)
            torch.testing.assert_close(got[0], want[0], equal_nan=True)
    assert jsd_spy.count == 0
