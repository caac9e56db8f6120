"""The use_fused_ce flag alone (no callback), config classes carrying it, loss-only evaluation,
and short errors that name another library's forward wrapper."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fused_ce_patch import (
    FusedCECallback,
    FusedCETrainingArguments,
    UnsupportedModelError,
    apply_fused_ce,
    fused_ce_config,
    revert_fused_ce,
)
from fused_ce_patch.errors import FusedCEFlagError
from fused_ce_patch.hf.patch import is_fused_ce_applied
from hf_helpers import LOSS_RTOL, assert_close_rel, build_model, reference_copy
from test_trainer import logged_losses, make_dataset


def _args(cls, tmp_path, **extra):
    return cls(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
               learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
               max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True,
               save_strategy="no", seed=0, dataloader_num_workers=0, **extra)


def _callbacks(trainer):
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FusedCECallback)]


def test_flag_alone_patches_and_matches_stock(tmp_path, spy):
    model = build_model("llama")
    ref = reference_copy(model)
    t_ref = Trainer(model=ref, args=_args(TrainingArguments, tmp_path / "r"),
                    train_dataset=make_dataset())
    t_ref.train()
    t = Trainer(model=model, args=_args(FusedCETrainingArguments, tmp_path / "f",
                                        use_fused_ce=True),
                train_dataset=make_dataset())
    assert is_fused_ce_applied(model) and len(_callbacks(t)) == 1
    t.train()
    assert spy.count == 2
    assert_close_rel(logged_losses(t), logged_losses(t_ref), LOSS_RTOL, "losses")
    revert_fused_ce(model)
    assert not is_fused_ce_applied(model) and "forward" not in model.__dict__


def test_flag_off_and_explicit_callback_not_doubled(tmp_path):
    model = build_model("llama")
    Trainer(model=model, args=_args(FusedCETrainingArguments, tmp_path))
    assert not is_fused_ce_applied(model)
    t = Trainer(model=model, args=_args(FusedCETrainingArguments, tmp_path, use_fused_ce=True),
                callbacks=[FusedCECallback()])
    assert is_fused_ce_applied(model) and len(_callbacks(t)) == 1


def test_fused_ce_config_adds_flag_to_any_arguments_class(tmp_path):
    from dataclasses import dataclass, field

    @dataclass
    class MyConfig(TrainingArguments):  # stands in for TRL's SFTConfig
        extra: int = field(default=3)

    cfg_cls = fused_ce_config(MyConfig)
    assert fused_ce_config(MyConfig) is cfg_cls and issubclass(cfg_cls, MyConfig)
    model = build_model("qwen2")
    Trainer(model=model, args=_args(cfg_cls, tmp_path, use_fused_ce=True, extra=4))
    assert is_fused_ce_applied(model)
    with pytest.raises(TypeError):
        fused_ce_config(int)


def test_flag_never_silent_without_callback(tmp_path):
    class Peek(Trainer):
        def peek(self):
            return self.args.train_batch_size

    t = Peek(model=build_model("llama"), args=_args(TrainingArguments, tmp_path))
    t.args = _args(FusedCETrainingArguments, tmp_path, use_fused_ce=True)
    with pytest.raises(FusedCEFlagError, match="callbacks=\\[FusedCECallback\\(\\)\\]"):
        t.peek()


def test_eval_loss_only_skips_logits(tmp_path, spy):
    model = build_model("llama")
    ref = reference_copy(model)
    ds = make_dataset()
    want = Trainer(model=ref, args=_args(TrainingArguments, tmp_path / "r"),
                   eval_dataset=ds).evaluate()
    t = Trainer(model=model, args=_args(FusedCETrainingArguments, tmp_path / "f",
                                        use_fused_ce=True), eval_dataset=ds)
    got = t.evaluate()
    assert spy.count > 0  # the fused path computed the eval loss (no logits)
    assert abs(got["eval_loss"] - want["eval_loss"]) <= LOSS_RTOL * abs(want["eval_loss"])
    calls = spy.count
    # with compute_metrics the logits are real
    seen = []

    def metrics(p):
        seen.append(p.predictions.shape)
        return {}

    t2 = Trainer(model=model, args=_args(FusedCETrainingArguments, tmp_path / "m",
                                         use_fused_ce=True), eval_dataset=ds,
                 compute_metrics=metrics)
    got2 = t2.evaluate()
    assert spy.count == calls and seen and seen[0][-1] == model.config.vocab_size
    assert abs(got2["eval_loss"] - want["eval_loss"]) <= LOSS_RTOL * abs(want["eval_loss"])


def test_error_names_other_library_briefly():
    model = build_model("llama")

    def lce_forward(self, *a, **k):  # what a peer's instance patch looks like
        raise AssertionError

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"
    model.forward = types.MethodType(lce_forward, model)
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model)
    msg = str(info.value)
    assert "liger_kernel" in msg and "lce_forward" in msg and len(msg) < 400
    assert "LlamaDecoderLayer" not in msg  # no model dump
    assert torch.is_tensor(model.lm_head.weight)


def test_liger_fused_loss_conflict_is_a_short_error(tmp_path):
    args = _args(FusedCETrainingArguments, tmp_path, use_fused_ce=True)
    args.use_liger_kernel = True  # set after construction: Liger itself is not installed here
    with pytest.raises(ValueError, match="Liger Kernel") as info:
        Trainer(model=build_model("llama"), args=args)
    assert "fused_linear_cross_entropy': False" in str(info.value) and len(str(info.value)) < 300
    args.liger_kernel_config = {"fused_linear_cross_entropy": False}
    model = build_model("llama")
    Trainer(model=model, args=args)
    assert is_fused_ce_applied(model)


@dataclasses.dataclass
class PickleConfig(TrainingArguments):
    """A config class of another library (module level: pickle finds it by name)."""


def test_generated_config_class_pickles_as_its_stock_base(tmp_path):
    import copy
    import pickle
    import sys

    cfg_cls = fused_ce_config(PickleConfig)
    args = cfg_cls(output_dir=str(tmp_path), use_fused_ce=True, use_cpu=True, report_to=[])
    back = pickle.loads(pickle.dumps(args))  # what Trainer's training_args.bin holds
    assert type(back) is PickleConfig and not hasattr(back, "use_fused_ce")
    assert back.output_dir == args.output_dir and back.use_cpu
    for clone in (copy.copy(args), copy.deepcopy(args)):  # copies in the process keep the flag
        assert type(clone) is cfg_cls and clone.use_fused_ce
    assert getattr(sys.modules["fused_ce_patch.hf.trainer"], cfg_cls.__name__) is cfg_cls


def test_checkpoint_arguments_load_without_the_plugin(tmp_path):
    """training_args.bin of a flagged run loads where fused_ce_patch cannot be imported."""
    import subprocess
    import sys

    args = _args(FusedCETrainingArguments, tmp_path, use_fused_ce=True)
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    code = (
        "import sys; sys.modules['fused_ce_patch'] = None\n"  # import blocked
        "import torch, transformers\n"
        f"a = torch.load({str(path)!r}, weights_only=False)\n"
        "assert type(a) is transformers.TrainingArguments, type(a)\n"
        "print(a.max_steps)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("2")


@pytest.mark.parametrize("field", ["use_fused_ce", "fused_ce_return_logits"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_bool_fields_must_be_bools(field, value, tmp_path):
    with pytest.raises(TypeError, match=field):
        _args(FusedCETrainingArguments, tmp_path, **{field: value})


def test_flag_on_a_model_without_a_vocabulary_head_warns_and_trains(tmp_path, caplog):
    """A reward model (TRL's RewardTrainer): one short warning, no patch, training runs."""
    import logging

    from transformers import LlamaForSequenceClassification

    from hf_helpers import tiny_config
    from test_trainer import make_dataset

    torch.manual_seed(0)
    cfg = tiny_config("llama", num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(cfg)
    rows = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"],
             "labels": torch.tensor(float(i % 2))} for i, r in enumerate(make_dataset())]
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        trainer = Trainer(model=model, train_dataset=rows,
                          args=_args(FusedCETrainingArguments, tmp_path, use_fused_ce=True))
    trainer.train()
    warned = [r.getMessage() for r in caplog.records if "use_fused_ce" in r.getMessage()]
    assert len(warned) == 1 and len(warned[0]) < 400, warned
    assert not is_fused_ce_applied(model)


def test_trl_parser_recipe_reads_the_flag_from_the_command_line_and_yaml(tmp_path):
    """design.md's two-line recipe for TRL's own parser (``trl sft`` cannot take our flag)."""
    pytest.importorskip("trl")
    try:
        from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser
    except ImportError as exc:  # an older trl without one of these names
        pytest.skip(f"this trl lacks {exc.name or exc}")

    parser = TrlParser((fused_ce_config(SFTConfig), ScriptArguments, ModelConfig))
    cfg, *_ = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_fused_ce", "--use_cpu", "--bf16", "false",
         "--dataset_name", "x"])
    assert cfg.use_fused_ce is True
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"output_dir: {tmp_path}\nuse_fused_ce: true\nuse_cpu: true\nbf16: false\n"
                    f"dataset_name: x\n")
    cfg, *_ = parser.parse_args_and_config(["--config", str(yaml)])
    assert cfg.use_fused_ce is True


def _fp16_on_cpu_runs(tmp_path) -> bool:
    """Whether this transformers/accelerate lets Trainer train fp16 on the CPU (stock)."""
    from accelerate.state import AcceleratorState

    try:
        Trainer(model=build_model("llama"), args=_args(TrainingArguments, tmp_path / "probe",
                                                      fp16=True),
                train_dataset=make_dataset()).train()
    except (ValueError, RuntimeError, NotImplementedError):
        return False
    finally:
        AcceleratorState._reset_state(True)
    return True


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_flag_with_every_precision_matches_stock_at_that_precision(precision, tmp_path, spy,
                                                                   caplog):
    # issue 38.1: accelerate's mixed-precision wrapper goes on at train() over the forward the
    # flag patched at Trainer.__init__; the flag must train, as stock does at that precision.
    from accelerate.state import AcceleratorState

    extra = {} if precision == "fp32" else {precision: True}
    if precision == "fp16" and not _fp16_on_cpu_runs(tmp_path):
        # stock refuses fp16 on this CPU too; the flag must refuse the same way
        with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
            Trainer(model=build_model("llama"), args=_args(
                FusedCETrainingArguments, tmp_path / "f", use_fused_ce=True, **extra),
                train_dataset=make_dataset()).train()
        AcceleratorState._reset_state(True)
        return
    init = build_model("llama")
    try:
        t_ref = Trainer(model=reference_copy(init),
                        args=_args(TrainingArguments, tmp_path / "r", **extra),
                        train_dataset=make_dataset())
        t_ref.train()
        AcceleratorState._reset_state(True)
        assert spy.count == 0
        with caplog.at_level("WARNING", logger="fused_ce_patch"):
            t = Trainer(model=reference_copy(init),
                        args=_args(FusedCETrainingArguments, tmp_path / "f", use_fused_ce=True,
                                   **extra), train_dataset=make_dataset())
            t.train()
    finally:
        AcceleratorState._reset_state(True)
    assert spy.count == 2 and is_fused_ce_applied(t.model)
    assert "not patched at train begin" not in caplog.text
    # fp32: float32 rounding (LOSS_RTOL); bf16/fp16: a few ulps of the 16-bit logits
    rtol = LOSS_RTOL if precision == "fp32" else 4 * (2.0 ** -8 if precision == "bf16"
                                                      else 2.0 ** -11)
    assert_close_rel(logged_losses(t), logged_losses(t_ref), rtol, precision)
