"""The derived architecture rows, the parity sweep, and its record (docs/support.json)."""

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
SUPPORT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "support.md"


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
    from transformers import MusicgenForCausalLM, XLMWithLMHeadModel

    with pytest.raises(UnsupportedModelError, match=r"inside `self.pred_layer\(\.\.\., labels"):
        derive_spec(XLMWithLMHeadModel)  # its prediction layer computes the loss
    with pytest.raises(UnsupportedModelError,
                       match=r"one head per output stream \(`self.lm_heads`\)"):
        derive_spec(MusicgenForCausalLM)  # one head per codebook, stacked


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


def test_the_record_is_not_read_at_patch_time(monkeypatch):
    """docs/support.json is documentation: patching works without it (the proof decides)."""
    def unreadable(*args, **kwargs):
        raise AssertionError("the record was read at patch time")

    monkeypatch.setattr(verified, "load", unreadable)
    model = _tiny("qwen3")
    apply_fused_ce(model)


def test_proven_type_patched_and_class_patch(spy):
    model = _tiny("qwen3")
    b = sweep._batches(model.config, torch)["padded"]
    owner = apply_fused_ce_to_class(type(model))
    assert owner is type(model)
    out = model(**b)
    assert spy.count == 1 and isinstance(out.logits, NotMaterializedLogits)
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce(type(model))
    assert isinstance(model(**b).logits, torch.Tensor) and spy.count == 1


def test_support_page_table_matches_the_record():
    """docs/support.md's table is exactly what the sweep generates from docs/support.json."""
    text = SUPPORT_PAGE.read_text()
    block = text.split(sweep.BEGIN, 1)[1].split(sweep.END, 1)[0].strip()
    assert block == sweep.support_table(verified.load()).strip(), (
        "docs/support.md's table is stale: run python -m fused_ce_patch.hf.sweep --types '' "
        "--docs docs/support.md --readme README.md"
    )


def test_readme_summary_matches_the_record():
    """README's front-page summary is generated too, from the same record."""
    text = README.read_text()
    block = text.split(sweep.SUMMARY_BEGIN, 1)[1].split(sweep.SUMMARY_END, 1)[0].strip()
    assert block == sweep.support_summary(verified.load()).strip(), (
        "README's support summary is stale: run python -m fused_ce_patch.hf.sweep --types '' "
        "--readme README.md"
    )
    assert sweep.BEGIN not in text  # the full table lives in docs/support.md only


def test_generators_rewrite_only_between_their_markers(tmp_path):
    data = {"types": {"llama": {"5.24.0": {"status": "pass", "class": "LlamaForCausalLM"}}}}
    page = tmp_path / "support.md"
    page.write_text(f"intro\n{sweep.BEGIN}\nold\n{sweep.END}\noutro\n")
    assert sweep.write_docs(page, data) and not sweep.write_docs(page, data)
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| llama | LlamaForCausalLM |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{sweep.SUMMARY_BEGIN}\n{sweep.SUMMARY_END}\nb\n")
    assert sweep.write_readme(readme, data)
    assert "5.24.0: 1 of 1" in readme.read_text()
    with pytest.raises(ValueError, match="markers"):
        sweep.write_docs(readme, data)


def test_check_against_record():
    data = {"types": {
        "a": {"5.17.0": {"status": "pass"}, "5.24.0": {"status": "pass"}},
        "b": {"5.17.0": {"status": "pass"}, "5.24.0": {"status": "unbuildable"}},
        "c": {"5.24.0": {"status": "pass"}},
    }}
    rows = [{"type": "a", "status": "fail", "reason": "loss 2 vs stock 1"},
            {"type": "b", "status": "pass"}, {"type": "c", "status": "pass"}]
    assert sweep.check_against_record(rows, data, "5.24.0") == (
        "5.24.0", ["a: fail: loss 2 vs stock 1"], ["b"])
    # a release not recorded is held to the newest recorded one before it
    assert sweep.check_against_record(rows, data, "5.21.1")[0] == "5.17.0"
    assert sweep.check_against_record(rows, data, "5.30.0")[0] == "5.24.0"
    assert sweep.check_against_record(rows, data, "5.0.0")[0] == "5.24.0"
    # a missing record is an error, never a silent pass
    assert sweep.main(["--types", "", "--check", "--record", "/nonexistent/support.json"]) == 2


@pytest.mark.slow
def test_sweep_matches_the_record():
    """Re-run the whole sweep on the installed transformers; it must reproduce the record.

    A transformers upgrade that breaks a passing type fails here loudly (the package itself
    would refuse that type at apply time, with the reason).
    """
    version = transformers.__version__
    data = verified.load()
    recorded = {t: rows[version] for t, rows in data["types"].items() if version in rows}
    jobs = int(os.environ.get("FUSED_CE_SWEEP_JOBS", min(2, os.cpu_count() or 1)))
    rows = sweep.run(jobs=jobs, progress=False)
    baseline, lost, gained = sweep.check_against_record(rows, data, version)
    assert not lost, lost
    if recorded:
        assert not gained, f"newly passing, re-record docs/support.json: {gained}"
        by_type = {r["type"]: r for r in rows}
        assert set(by_type) == set(recorded), set(by_type) ^ set(recorded)
        for t, r in by_type.items():
            if r["status"] == "pass":
                assert r["source_hash"] == recorded[t]["source_hash"], t
    assert re.search(r"\d+ of \d+", sweep.support_table(data))
    json.dumps(rows)


def test_refused_types_are_listed_by_kind(tmp_path):
    """docs/support.md lists separately what the patch cannot express, what it would change,
    and what has no stock model here, with counts per release; a row proven on the default
    config shrunk (not tiny.py's) says so in the record."""
    data = {"types": {
        "a": {"5.24.0": {"status": "unsupported", "reason": "a head with a transform"},
              "5.25.0": {"status": "unsupported", "reason": "a head with a transform"}},
        "b": {"5.24.0": {"status": "unbuildable", "reason": "tiny model: KeyError"},
              "5.25.0": {"status": "pass", "class": "B"}},
        "c": {"5.25.0": {"status": "fail", "reason": "loss 2 vs stock 1"}},
    }}
    table = sweep.support_table(data)
    kinds = [line for line in table.splitlines() if line.startswith("<details>")]
    assert kinds == [
        "<details><summary>Refused by the patch: it cannot express this forward "
        "(5.24.0: 1, 5.25.0: 1)</summary>",
        "<details><summary>Refused: the patched forward differs from stock, or raised "
        "(5.25.0: 1)</summary>",
        "<details><summary>Not proven: no stock model built from the class's default config "
        "trains here (a model from your own config is proven on it) (5.24.0: 1)</summary>",
    ]
    record = tmp_path / "support.json"
    sweep.write_record([{"type": "b", "class": "B", "status": "pass",
                         "config": "the class's default config as a user's, shrunk"},
                        {"type": "d", "class": "D", "status": "pass",
                         "config": "the class's default config"}], record)
    rows = {t: next(iter(r.values())) for t, r in json.loads(record.read_text())["types"].items()}
    assert rows["b"]["config"].endswith("shrunk") and "config" not in rows["d"]
