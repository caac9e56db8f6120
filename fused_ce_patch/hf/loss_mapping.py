"""The ``LOSS_MAPPING`` replacement: transformers' causal-LM loss without the float32 logits copy.

When a model does materialise its logits (evaluation, ``return_logits=True``, a custom head),
transformers computes the loss with ``ForCausalLMLoss``, whose first line is
``logits = logits.float()``: a full ``[tokens, vocab]`` float32 copy (plus its gradient) on top
of the logits. :func:`chunked_causal_lm_loss` computes the same value and gradient over row
chunks: forward keeps one float32 log-sum-exp per row; backward recomputes the softmax chunk by
chunk and writes the gradient in the logits' dtype.

Registration (:func:`register` / :func:`unregister`) swaps every ``LOSS_MAPPING`` value that
*is* ``ForCausalLMLoss`` (``ForCausalLM``, ``ForConditionalGeneration``,
``CsmForConditionalGeneration`` on 5.24) and restores the exact original objects.

The Trainer identity pitfall: ``Trainer.__init__`` decides how it counts ``num_items_in_batch``
with ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` (``transformers/trainer.py``,
``_loss_shifts_labels``), where ``ForCausalLMLoss`` is the name ``trainer.py`` imported. With
only the mapping swapped that test turns False, and the Trainer counts ``labels`` instead of
``labels[..., 1:]``: one token too many per row, a loss scaled too small. So while registered
the replacement also takes the name ``ForCausalLMLoss`` in ``transformers.loss.loss_utils`` (so a
``transformers.trainer`` imported later binds it) and in ``transformers.trainer`` (if already
imported): the identity test stays true, and stays correct, since the replacement shifts labels
exactly as ``ForCausalLMLoss`` does.
"""

from __future__ import annotations

import sys
import threading

import torch

from ..errors import raise_if_double_backward

#: Bytes of float32 logits one chunk may hold in :func:`chunked_causal_lm_loss`.
CHUNK_BYTES = 64 * 2**20


class _LogitsCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``scale * CE(logits[r], labels[r])``, chunked over rows.

    forward(logits [N, V] any float dtype, labels [N] int64 with -1 at ignored rows,
    scale float or 0-d tensor, chunk_rows int) -> 0-d float32. Like ``ForCausalLMLoss``
    (``logits.float()``), the arithmetic is float32 whatever the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, labels, scale, chunk_rows):
        acc = torch.float32
        n = logits.shape[0]
        lse = torch.empty(n, dtype=acc, device=logits.device)
        total = torch.zeros((), dtype=acc, device=logits.device)
        valid = labels >= 0
        for r0 in range(0, n, chunk_rows):
            r1 = min(r0 + chunk_rows, n)
            z = logits[r0:r1].to(acc)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[r0:r1] = lse_c
            zy = z.gather(1, labels[r0:r1].clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid[r0:r1], lse_c - zy, 0.0).sum()
        ctx.save_for_backward(logits, labels, lse)
        ctx.scale = scale
        ctx.chunk_rows = chunk_rows
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        raise_if_double_backward("the chunked LOSS_MAPPING causal-LM loss")
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        valid = labels >= 0
        coef = grad_out * ctx.scale
        n = logits.shape[0]
        for r0 in range(0, n, ctx.chunk_rows):
            r1 = min(r0 + ctx.chunk_rows, n)
            # A new tensor: for float32 logits `.to()` would alias them and the in-place
            # ops below would overwrite the caller's logits.
            p = (logits[r0:r1].to(lse.dtype) - lse[r0:r1].unsqueeze(1)).exp_()
            y = labels[r0:r1].clamp(min=0).unsqueeze(1)
            p.scatter_add_(1, y, -torch.ones_like(y, dtype=p.dtype))
            p.mul_(valid[r0:r1].to(p.dtype).unsqueeze(1)).mul_(coef)
            grad[r0:r1] = p
        return grad, None, None, None


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` computed in row chunks, without a float32 logits copy.

    Same call and same result as ``transformers.loss.loss_utils.ForCausalLMLoss``: labels are
    shifted left by one (the last position predicts nothing) unless ``shift_labels`` is given,
    ignored positions add nothing, and the result is ``sum / num_items_in_batch`` when that is
    given, else the mean over counted positions.

    Args:
        logits: ``[..., V]`` logits in any float dtype (kept in it; chunks are upcast).
        labels: ``[...]`` int labels (unshifted), or None when ``shift_labels`` is given.
        vocab_size: ``V``.
        num_items_in_batch: int or one-element tensor; the divisor for exact gradient
            accumulation (0 or less, which only an empty batch gives, counts as 1).
        ignore_index: label value of positions that count for nothing.
        shift_labels: ``[...]`` labels already shifted by the caller (never shifted again).
        **kwargs: ignored, as in ``ForCausalLMLoss``.

    Returns:
        0-d float32 loss (float32 arithmetic for every logits dtype, as ``ForCausalLMLoss``).

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index``.

    Deviation: with no counted position and no ``num_items_in_batch`` the result is 0.0 with
    zero gradients (``ForCausalLMLoss`` gives NaN), as everywhere in fused_ce_patch, so a fully
    padded micro-batch cannot poison gradient accumulation.
    """
    if shift_labels is None:
        pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
        shift_labels = torch.cat([labels[..., 1:], pad], dim=-1)
    flat = logits.reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(device=flat.device, dtype=torch.long)
    if target.shape[0] != flat.shape[0]:
        raise ValueError(
            f"Expected input batch_size ({flat.shape[0]}) to match target batch_size "
            f"({target.shape[0]}): logits {tuple(logits.shape)}, labels "
            f"{tuple(shift_labels.shape)}"
        )
    counted = target != ignore_index
    lo_hi = torch.stack(torch.aminmax(torch.where(counted, target, 0))) if target.numel() else None
    n_valid = int(counted.sum())
    if lo_hi is not None and n_valid:
        lo, hi = (int(v) for v in lo_hi.tolist())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"label {bad} is outside [0, V) with V = {vocab_size} and is not "
                f"ignore_index = {ignore_index}"
            )
    target = torch.where(counted, target, -1)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            n = num_items_in_batch.detach().reshape(()).to(flat.device).float()
            scale = 1.0 / torch.where(n > 0, n, 1.0)
        else:
            scale = 1.0 / num_items_in_batch if num_items_in_batch > 0 else 1.0
    else:
        scale = 1.0 / max(n_valid, 1)
    chunk_rows = max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))
    return _LogitsCrossEntropy.apply(flat, target, scale, chunk_rows)


# -- registration ----------------------------------------------------------------------------

_LOCK = threading.Lock()
_saved: dict | None = None  # what register() replaced, to restore exactly


def _loss_utils():
    import transformers.loss.loss_utils as loss_utils

    return loss_utils


def original_causal_lm_loss():
    """transformers' own ``ForCausalLMLoss`` (also while the replacement is registered)."""
    if _saved is not None:
        return _saved["original"]
    return _loss_utils().ForCausalLMLoss


def is_registered() -> bool:
    return _saved is not None


def register() -> None:
    """Put :func:`chunked_causal_lm_loss` wherever ``ForCausalLMLoss`` is looked up.

    Every ``LOSS_MAPPING`` key whose value is ``ForCausalLMLoss``, and the module-level name
    ``ForCausalLMLoss`` in ``transformers.loss.loss_utils`` and ``transformers.trainer`` (see
    the module docstring for why). Idempotent.
    """
    global _saved
    with _LOCK:
        if _saved is not None:
            return
        loss_utils = _loss_utils()
        original = loss_utils.ForCausalLMLoss
        mapping = loss_utils.LOSS_MAPPING
        keys = [k for k, v in mapping.items() if v is original]
        saved = {"original": original, "keys": keys, "trainer": False}
        for key in keys:
            mapping[key] = chunked_causal_lm_loss
        loss_utils.ForCausalLMLoss = chunked_causal_lm_loss
        trainer = sys.modules.get("transformers.trainer")
        if trainer is not None and getattr(trainer, "ForCausalLMLoss", None) is original:
            trainer.ForCausalLMLoss = chunked_causal_lm_loss
            saved["trainer"] = True
        _saved = saved


def unregister() -> None:
    """Restore the exact objects :func:`register` replaced. Idempotent."""
    global _saved
    with _LOCK:
        if _saved is None:
            return
        loss_utils = _loss_utils()
        original = _saved["original"]
        mapping = loss_utils.LOSS_MAPPING
        for key in _saved["keys"]:
            if mapping.get(key) is chunked_causal_lm_loss:
                mapping[key] = original
        if loss_utils.ForCausalLMLoss is chunked_causal_lm_loss:
            loss_utils.ForCausalLMLoss = original
        # Also covers a transformers.trainer imported after register(), which bound our name.
        trainer = sys.modules.get("transformers.trainer")
        if getattr(trainer, "ForCausalLMLoss", None) is chunked_causal_lm_loss:
            trainer.ForCausalLMLoss = original
        _saved = None


def is_causal_lm_loss(fn) -> bool:
    """True for ``ForCausalLMLoss`` and its replacement (the fused loss computes both)."""
    return fn is chunked_causal_lm_loss or fn is original_causal_lm_loss()
