"""Trainer integration: a ``use_fused_ce`` flag and the callback that acts on it.

Usage with transformers' Trainer::

    from fused_ce_patch import FusedCECallback, FusedCETrainingArguments

    args = FusedCETrainingArguments(output_dir="out", use_fused_ce=True, bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FusedCECallback()])
    trainer.train()

The flag alone does nothing: Trainer builds its callbacks from its ``callbacks`` argument, so
the callback must be passed. The callback patches the model in ``on_init_end`` — the end of
``Trainer.__init__``, before ``Trainer.train`` runs ``accelerator.prepare``, whose native
mixed-precision wrapper binds ``model.forward`` at prepare time (accelerate 1.x
``Accelerator.prepare_model``); patching later would lose autocast. Token counting stays exact:
``Trainer.__init__`` has already decided how to count ``num_items_in_batch`` by then, and the
patch leaves ``LOSS_MAPPING`` untouched, so that decision is the stock one anyway (see
:mod:`fused_ce_patch.hf.loss_mapping`). Calling ``apply_fused_ce(model)`` before building the
Trainer is equivalent.

With ``model_init`` (a fresh model per ``train()``), Trainer re-creates the model after
``on_init_end`` and never shows callbacks the new one: patch inside ``model_init`` instead
(``return apply_fused_ce(make_model())`` or ``AutoFusedCEForCausalLM.from_pretrained``).

TRL's ``SFTTrainer`` (``SFTConfig`` subclasses ``TrainingArguments``):

- Patch through the callback, ``SFTTrainer(..., callbacks=[FusedCECallback()])`` (arguments
  without a ``use_fused_ce`` field count as enabled), or call ``apply_fused_ce(model)`` before
  building the trainer (after it, the instance forward is TRL's and is refused). A PEFT model
  made by ``SFTTrainer(peft_config=...)`` already exists at ``on_init_end``.
- ``SFTConfig`` turns ``bf16`` on by default; the callback patches before accelerate prepares
  the model, so the fused loss runs under that autocast.
- TRL 1.16 (run here with transformers 5.17): ``SFTTrainer.__init__`` wraps the forward it finds
  (ours, when patched by then) with its own chunked LM head (``trl.trainer.utils.
  add_fused_lm_head``) and its ``compute_loss`` trains through
  ``model(..., fused_lm_head=True)``, so TRL's head, not fused_ce_patch, computes the training
  loss (no full logits either way); calls without ``fused_lm_head`` reach the patched forward.
- TRL up to 1.10 (``sft_trainer.py`` source): ``compute_loss`` with the default
  ``loss_type="nll"`` and ``use_liger_kernel=False`` computes the logged ``entropy`` and
  ``mean_token_accuracy`` from ``outputs.logits`` on every step, which on the fused path raises
  :class:`~fused_ce_patch.errors.LogitsNotMaterializedError`
  (``FusedCECallback(return_logits=True)`` avoids it at the usual memory cost).
- To have fused_ce_patch compute the training loss with either version, route training steps
  through transformers' own ``compute_loss`` (TRL's two training metrics are then not logged;
  evaluation keeps TRL's, with real logits). Checked on TRL 1.16: same losses as TRL's own
  head within 1e-5 in float32::

      class FusedSFTTrainer(SFTTrainer):
          def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
              if not model.training:
                  return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
              inputs["use_cache"] = False
              return Trainer.compute_loss(self, model, inputs, return_outputs,
                                          num_items_in_batch)

- Do not combine with Liger's fused linear cross-entropy (``use_liger_kernel=True`` with its
  default config): it replaces the same forward at ``train()`` time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import TrainerCallback, TrainingArguments

from ..types import BackendName
from .patch import make_options, apply_fused_ce, is_fused_ce_applied

logger = logging.getLogger(__name__)


@dataclass
class FusedCETrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the fused-loss flag and its options.

    Read by :class:`FusedCECallback` (which must be passed to the Trainer); every other field
    is ``TrainingArguments``' own, and ``HfArgumentParser`` picks the new ones up
    (``--use_fused_ce``, ``--fused_ce_backend``, ...).

    Attributes:
        use_fused_ce: patch the model with :func:`~fused_ce_patch.apply_fused_ce`.
        fused_ce_backend: backend of the fused loss (``"auto"``, ``"torch"``, ``"triton"``,
            ``"ascend"``, ``"reference"``).
        fused_ce_logits_budget: bytes of transient logits per chunk; None = backend default.
        fused_ce_return_logits: keep real logits on every step (no memory saving).
    """

    use_fused_ce: bool = field(
        default=False,
        metadata={"help": "Compute the causal-LM training loss with fused_ce_patch's fused "
                          "linear-cross-entropy (no [tokens, vocab] logits). Needs "
                          "callbacks=[FusedCECallback()]."},
    )
    fused_ce_backend: str = field(
        default="auto",
        metadata={"help": "Backend of the fused loss: auto, triton, ascend, torch, reference."},
    )
    fused_ce_logits_budget: int | None = field(
        default=None,
        metadata={"help": "Bytes of transient logits one chunk may hold (default: backend's)."},
    )
    fused_ce_return_logits: bool = field(
        default=False,
        metadata={"help": "Keep real logits on training steps (no memory saving)."},
    )

    def __post_init__(self):
        super().__post_init__()
        # Fail at argument parsing, not later inside Trainer.__init__.
        make_options(self.fused_ce_backend, self.fused_ce_logits_budget,
                      self.fused_ce_return_logits)


class FusedCECallback(TrainerCallback):
    """Applies :func:`~fused_ce_patch.apply_fused_ce` to the Trainer's model at ``on_init_end``.

    Args:
        enabled: force on/off; None reads ``args.use_fused_ce`` and counts arguments without
            that field (plain ``TrainingArguments``, TRL's ``SFTConfig``) as on.
        backend: overrides ``args.fused_ce_backend`` (default ``"auto"``).
        logits_budget: overrides ``args.fused_ce_logits_budget``.
        return_logits: overrides ``args.fused_ce_return_logits``.

    ``on_train_begin`` checks again and patches (with a warning) if the model was unpatched
    in between; accelerate's prepared forward is then rebuilt around the patch.
    """

    def __init__(
        self,
        *,
        enabled: bool | None = None,
        backend: BackendName | None = None,
        logits_budget: int | None = None,
        return_logits: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.backend = backend
        self.logits_budget = logits_budget
        self.return_logits = return_logits

    def _is_enabled(self, args) -> bool:
        if self.enabled is not None:
            return bool(self.enabled)
        return bool(getattr(args, "use_fused_ce", True))

    def _options(self, args) -> dict:
        def pick(mine, name, default):
            return mine if mine is not None else getattr(args, name, default)

        return {
            "backend": pick(self.backend, "fused_ce_backend", "auto"),
            "logits_budget": pick(self.logits_budget, "fused_ce_logits_budget", None),
            "return_logits": pick(self.return_logits, "fused_ce_return_logits", False),
        }

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self._is_enabled(args):
            apply_fused_ce(model, **self._options(args))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._is_enabled(args) and not is_fused_ce_applied(model):
            logger.warning(
                "fused_ce_patch: the model was not patched at train begin; patching it now"
            )
            apply_fused_ce(model, **self._options(args))
