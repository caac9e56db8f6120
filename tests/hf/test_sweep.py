"""The derived architecture rows, the support decision, and the parity sweep itself."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import transformers

from fused_ce_patch import UnsupportedModelError, apply_fused_ce, apply_fused_ce_to_class
from fused_ce_patch.hf import sweep, verified
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.sentinel import NotMaterializedLogits

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    "cls, transform, expr, moe",
    [
        ("LlamaForCausalLM", "none", (), False),
        ("CohereForCausalLM", "multiplier", ("mul self.logit_scale",), False),
        ("GraniteForCausalLM", "divisor", ("div self.config.logits_scaling",), False),
        ("Gemma2ForCausalLM", "softcap", ("softcap self.config.final_logit_softcapping",), False),
        ("FalconH1ForCausalLM", "multiplier", ("mul self.model.lm_head_multiplier",), False),
        ("MixtralForCausalLM", "none", (), True),
        ("Qwen3MoeForCausalLM", "none", (), True),
    ],
)
def test_derived_rows(cls, transform, expr, moe):
    spec = derive_spec(getattr(transformers, cls))
    assert spec.transform_name == transform and spec.transform == expr
    assert spec.moe_aux is moe and spec.head_attr == "lm_head"


def test_derivation_refuses_unknown_statements():
    from transformers import BambaForCausalLM, BertLMHeadModel

    with pytest.raises(UnsupportedModelError, match="does more than the loss call"):
        derive_spec(BambaForCausalLM)  # z-loss on materialised logits
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        derive_spec(BertLMHeadModel)  # head is self.cls(...)


@pytest.mark.parametrize("model_type", ["qwen3", "cohere", "granite", "qwen3_moe"])
def test_sweep_check_passes(model_type):
    row = sweep.check_type(model_type)
    assert row["status"] == "pass", row


def test_sweep_catches_a_wrong_transform(monkeypatch):
    """A rewrite that drops Cohere's logit_scale must fail the sweep (the check can fail)."""
    from fused_ce_patch.hf import forward

    monkeypatch.setattr(forward, "_transform", lambda logits, *a: logits)  # read at each call
    row = sweep.check_type("cohere")
    assert row["status"] == "fail" and "loss" in row["reason"], row


def _tiny(model_type):
    torch.manual_seed(0)
    cfg = sweep.tiny_config(model_type)
    cls = getattr(transformers, transformers.models.auto.modeling_auto
                  .MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return cls(cfg).train()


def test_unverified_source_is_refused(monkeypatch):
    model = _tiny("qwen3")
    monkeypatch.setattr(verified, "proofs_for", lambda *a: [])
    monkeypatch.setattr(verified, "refusal_for", lambda *a: None)
    with pytest.raises(UnsupportedModelError, match="not verified Qwen3ForCausalLM"):
        apply_fused_ce(model)
    monkeypatch.setenv(verified.ALLOW_ENV, "1")
    apply_fused_ce(model)  # explicit opt-in: patched with a warning


def test_verified_type_patched_and_class_patch(spy):
    if "qwen3" not in verified.verified_types():
        pytest.skip(f"qwen3 not verified on transformers {transformers.__version__}")
    model = _tiny("qwen3")
    b = sweep._batches(model.config, torch)["padded"]
    owner = apply_fused_ce_to_class(type(model))
    assert owner is type(model)
    out = model(**b)
    assert spy.count == 1 and isinstance(out.logits, NotMaterializedLogits)
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce(type(model))
    assert isinstance(model(**b).logits, torch.Tensor) and spy.count == 1


def test_readme_table_matches_verified_json():
    """README's table is exactly what the sweep generates from the committed verified.json."""
    text = README.read_text()
    block = text.split(sweep.BEGIN, 1)[1].split(sweep.END, 1)[0].strip()
    assert block == sweep.support_table(verified.load()).strip(), (
        "README support table is stale: run python -m fused_ce_patch.hf.sweep --types '' "
        "--readme README.md"
    )


@pytest.mark.slow
def test_sweep_matches_committed_results():
    """Re-run the whole sweep on the installed transformers; it must reproduce verified.json.

    A transformers upgrade that breaks a verified type, or one not recorded at all, fails here
    loudly (the package already refuses such a type at apply time).
    """
    version = transformers.__version__
    recorded = {t: rows[version] for t, rows in verified.load()["types"].items()
                if version in rows}
    assert recorded, (f"transformers {version} has no sweep results in verified.json: run "
                      f"python -m fused_ce_patch.hf.sweep --write --readme README.md")
    jobs = int(os.environ.get("FUSED_CE_SWEEP_JOBS", min(2, os.cpu_count() or 1)))
    rows = {r["type"]: r for r in sweep.run(jobs=jobs, progress=False)}
    lost = sorted(t for t, r in recorded.items()
                  if r["status"] == "pass" and rows.get(t, {}).get("status") != "pass")
    gained = sorted(t for t, r in rows.items()
                    if r["status"] == "pass" and recorded.get(t, {}).get("status") != "pass")
    assert not lost, {t: rows.get(t) for t in lost}
    assert not gained, f"newly passing, re-record verified.json: {gained}"
    assert set(rows) == set(recorded), set(rows) ^ set(recorded)
    for t, r in rows.items():
        if r["status"] == "pass":
            assert r["source_hash"] == recorded[t]["source_hash"], t
    assert re.search(r"\d+ of \d+", sweep.support_table(verified.load()))
    json.dumps(rows)
