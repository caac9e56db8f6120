"""TRL SFTTrainer with the callback and the documented compute_loss recipe (needs ``trl``)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; install trl to run this test")
datasets = pytest.importorskip("datasets")

from transformers import PreTrainedTokenizerFast, Trainer  # noqa: E402

from fused_ce_patch import FusedCECallback  # noqa: E402
from hf_helpers import LOSS_RTOL, VOCAB, assert_close_rel, build_model  # noqa: E402


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


class FusedSFTTrainer(trl.SFTTrainer):
    """The recipe documented in fused_ce_patch.hf.trainer."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs["use_cache"] = False
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)


def _run(trainer_cls, tmp_path, callbacks):
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, VOCAB, (12,), generator=g).tolist()} for _ in range(4)]
    # SFTConfig turns bf16 on by default; float32 keeps the comparison exact.
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                         learning_rate=0.1, optim="sgd", bf16=False, report_to=[], use_cpu=True,
                         logging_steps=1, save_strategy="no")
    trainer = trainer_cls(model=build_model("llama"), args=args,
                          train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=_tokenizer(), callbacks=callbacks)
    trainer.train()
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def test_sft_recipe_runs_fused_loss(tmp_path, spy):
    want = _run(trl.SFTTrainer, tmp_path / "plain", [])
    assert spy.count == 0
    got = _run(FusedSFTTrainer, tmp_path / "fused", [FusedCECallback()])
    assert spy.count == 2
    assert want[1] != want[0]  # the first step changed the weights
    assert_close_rel(got, want, LOSS_RTOL, "SFT losses")
