"""transformers Trainer: gradient accumulation, evaluation, bf16 autocast, flag and callback."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fused_ce_patch import FusedCECallback, FusedCETrainingArguments, apply_fused_ce
from fused_ce_patch.hf.patch import is_fused_ce_applied
from hf_helpers import (
    GRAD_RTOL,
    LOSS_RTOL,
    VOCAB,
    assert_close_rel,
    build_model,
    reference_copy,
)

SEQ = 12
COUNTS = (11, 0, 5, 1)  # counted (shifted) labels per sample: very unequal, one all-ignored


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def make_dataset(counts=COUNTS, seed=5):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in counts:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = torch.full_like(ids, -100)
        if c:
            labels[SEQ - c:] = ids[SEQ - c:]
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return ListDataset(rows)


def train(model, tmp_path, batch_size, accumulation, args_cls=TrainingArguments, callbacks=(),
          steps=2, **extra):
    args = args_cls(
        output_dir=str(tmp_path), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        dataloader_num_workers=0, **extra,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_dataset(),
                      callbacks=list(callbacks))
    trainer.train()
    return trainer


def logged_losses(trainer):
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_weights_close(got, want, rtol=GRAD_RTOL):
    assert got.keys() == want.keys()
    for name in want:
        assert_close_rel(got[name], want[name], rtol, name)


def test_gradient_accumulation_matches_stock_and_big_batch(tmp_path, spy):
    init = build_model("llama")
    ref = reference_copy(init)
    accumulated = reference_copy(init)
    big = reference_copy(init)
    start = params(init)

    ref_trainer = train(ref, tmp_path / "ref", 1, 4)
    assert spy.count == 0

    # Patched before Trainer.__init__: the LOSS_MAPPING identity pitfall case (must stay true).
    apply_fused_ce(accumulated)
    acc_trainer = train(accumulated, tmp_path / "acc", 1, 4)
    assert acc_trainer._loss_shifts_labels is True
    assert spy.count == 8  # 2 steps x 4 micro-batches, every one fused
    expected = sum(COUNTS)
    assert [int(c["num_items_in_batch"]) for c in spy.calls] == [expected] * 8

    spy.reset()
    big_trainer = train(big, tmp_path / "big", 4, 1, args_cls=FusedCETrainingArguments,
                        callbacks=[FusedCECallback()], use_fused_ce=True)
    assert spy.count == 2 and [int(c["num_items_in_batch"]) for c in spy.calls] == [expected] * 2

    want = logged_losses(ref_trainer)
    assert len(want) == 2 and torch.isfinite(want).all()
    assert_close_rel(logged_losses(acc_trainer), want, LOSS_RTOL, "losses, 1x4 fused vs stock")
    assert_close_rel(logged_losses(big_trainer), want, LOSS_RTOL, "losses, 4x1 fused vs 1x4 stock")
    ref_w = params(ref)
    assert any(not torch.equal(ref_w[n], start[n]) for n in start)  # training moved weights
    assert_weights_close(params(accumulated), ref_w)
    assert_weights_close(params(big), ref_w)


def test_evaluate_gives_compute_metrics_real_logits(tmp_path, spy):
    model = build_model("gemma2")
    ref = reference_copy(model).eval()
    seen = {}

    def compute_metrics(pred):
        seen["logits"] = pred.predictions
        return {"n": float(pred.predictions.size)}

    args = FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True, use_cpu=True,
                                    report_to=[], per_device_eval_batch_size=4)
    data = make_dataset()
    trainer = Trainer(model=model, args=args, eval_dataset=data, compute_metrics=compute_metrics,
                      callbacks=[FusedCECallback()])
    assert is_fused_ce_applied(model)
    metrics = trainer.evaluate()
    assert spy.count == 0
    rows = [data[i] for i in range(len(data))]
    with torch.no_grad():
        want = ref(input_ids=torch.stack([r["input_ids"] for r in rows]),
                   attention_mask=torch.stack([r["attention_mask"] for r in rows]),
                   labels=torch.stack([r["labels"] for r in rows]))
    assert_close_rel(torch.from_numpy(seen["logits"]), want.logits, LOSS_RTOL, "eval logits")
    assert metrics["eval_n"] == want.logits.numel()
    assert_close_rel(torch.tensor(metrics["eval_loss"]), want.loss, LOSS_RTOL, "eval loss")


def test_bf16_autocast_run_within_bf16_tolerance(tmp_path, spy):
    from accelerate.state import AcceleratorState

    init = build_model("qwen2")
    start = params(init)
    ref32 = reference_copy(init)
    ref16 = reference_copy(init)
    fused = reference_copy(init)
    try:
        t32 = train(ref32, tmp_path / "fp32", 2, 2)
        AcceleratorState._reset_state(True)
        t16 = train(ref16, tmp_path / "bf16", 2, 2, bf16=True)
        assert spy.count == 0
        AcceleratorState._reset_state(True)
        tf = train(fused, tmp_path / "fused", 2, 2, callbacks=[FusedCECallback()], bf16=True)
    finally:
        AcceleratorState._reset_state(True)
    # The patch was in place before accelerate wrapped forward: the fused loss ran under autocast.
    assert spy.count == 4
    assert all(c["autocast"] and c["autocast_dtype"] == torch.bfloat16 for c in spy.calls)

    want = logged_losses(t32)
    assert_close_rel(logged_losses(tf), want, 2e-2, "bf16 fused vs fp32 losses")
    assert_close_rel(logged_losses(tf), logged_losses(t16), 2e-2, "bf16 fused vs bf16 stock")
    w32, wf = params(ref32), params(fused)
    for name in start:  # compare what training changed, in bf16 tolerance
        assert_close_rel(wf[name] - start[name], w32[name] - start[name], 5e-2, name)


def test_callback_respects_flag_and_options(tmp_path):
    model = build_model("mistral")
    off = FusedCETrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    Trainer(model=model, args=off, callbacks=[FusedCECallback()])
    assert not is_fused_ce_applied(model)

    on = FusedCETrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                  use_fused_ce=True, fused_ce_backend="reference",
                                  fused_ce_logits_budget=1 << 20)
    Trainer(model=model, args=on, callbacks=[FusedCECallback(logits_budget=4096)])
    options = model._fused_ce_state.options
    assert (options.backend, options.logits_budget, options.return_logits) == \
        ("reference", 4096, False)

    other = build_model("mistral")
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    Trainer(model=other, args=plain, callbacks=[FusedCECallback()])  # e.g. TRL's SFTConfig
    assert is_fused_ce_applied(other)


def test_training_arguments_parse_from_command_line(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(FusedCETrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_fused_ce", "--fused_ce_backend", "torch",
         "--fused_ce_logits_budget", "65536", "--use_cpu"]
    )
    assert args.use_fused_ce and args.fused_ce_backend == "torch"
    assert args.fused_ce_logits_budget == 65536 and not args.fused_ce_return_logits


@pytest.mark.parametrize("arch", ["gemma3_text"])
def test_trainer_with_peft_model(arch, tmp_path, spy):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model(arch),
                                peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                modules_to_save=["lm_head"]))
    ref = reference_copy(model)
    t_ref = train(ref, tmp_path / "ref", 2, 2)
    t = train(model, tmp_path / "fused", 2, 2, callbacks=[FusedCECallback()])
    assert spy.count == 4 and t._loss_shifts_labels is True
    assert_close_rel(logged_losses(t), logged_losses(t_ref), LOSS_RTOL, "losses")
    assert_weights_close(params(model), params(ref))


def test_bad_fused_ce_options_fail_at_argument_construction(tmp_path):
    from fused_ce_patch import FusedCETrainingArguments

    with pytest.raises(ValueError, match="unknown backend"):
        FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True,
                                 fused_ce_backend="nonsense")
    with pytest.raises(ValueError, match="logits_budget"):
        FusedCETrainingArguments(output_dir=str(tmp_path), fused_ce_logits_budget=-1)
