"""Default tile size of the per-token statistics: never more transient logits than the
computation they stand in for (docs/design.md §5, "Tile policy").

:func:`~fused_ce_patch.fused_linear_token_stats` replaces chunked computations that already
bound their logits: TRL's fused LM head (trl >= 1.15) holds one ``[4096, 32768]`` tile,
trl 1.6-1.14's ``chunked_nll`` one float32 ``[256, V]`` chunk. A default budget sized for the
loss (hundreds of MiB) would, at a few hundred tokens, hold the whole ``[tokens, V]`` matrix at
once — more than the path it replaced. :func:`logits_budget` caps the default at the replaced
path's tile, so the bytes of transient logits a call holds are never more than it held, while
large calls (where the replaced tile is large too) keep the backend's large, fast chunks.

Each backend reads the budget as a cap on what it holds at once: backend ``"triton"`` on the
logits chunk (its row kernel works in place), the torch tiles on all the temporaries of one
tile (four float32 values per cell eager). Either way, at most ``logits_budget`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReplacedTiling:
    """The logits tile of a computation that the fused per-token statistics replace.

    Attributes:
        name: what it is (for messages and documentation).
        rows: most rows (tokens) one of its tiles holds.
        cols: vocabulary columns of one tile; None: the whole vocabulary.
        itemsize: bytes per stored logit; None: the compute dtype's (the input dtype, or the
            autocast dtype).
    """

    name: str
    rows: int
    cols: int | None = None
    itemsize: int | None = None

    def tile_bytes(self, rows: int, vocab: int, dtype: torch.dtype) -> int:
        """Bytes of the logits tile this computation holds for ``rows`` tokens of a
        ``vocab``-wide head in ``dtype`` (at least one row and column are counted)."""
        r = max(1, min(rows, self.rows))
        c = max(1, vocab if self.cols is None else min(vocab, self.cols))
        size = self.itemsize or torch.empty((), dtype=dtype).element_size()
        return r * c * size


#: TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``, trl >= 1.15): a preallocated
#: ``[min(N, 4096), 32768]`` projection buffer in the compute dtype, reused for every tile
#: (``TOKEN_CHUNK_SIZE`` rows, ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`` columns).
TRL_LOGPROB = ReplacedTiling("TRL's fused LM head (trl >= 1.15)", rows=4096, cols=32768)
#: trl 1.6-1.14's ``sft_trainer._chunked_cross_entropy_loss`` (``loss_type="chunked_nll"``):
#: chunks of 256 positions (``_CHUNKED_LM_HEAD_CHUNK_SIZE``), logits upcast to float32 over
#: the whole vocabulary, then ``log_softmax`` of them.
TRL_CHUNKED_NLL = ReplacedTiling("TRL's chunked_nll (trl 1.6-1.14)", rows=256, itemsize=4)


def logits_budget(rows: int, vocab: int, dtype: torch.dtype, replaced: ReplacedTiling,
                  default: int) -> int:
    """Default ``logits_budget`` of a per-token statistics call that replaces ``replaced``.

    Bound: the result is at most ``replaced.tile_bytes(rows, vocab, dtype)``, the bytes of the
    replaced path's own logits tile (``min(rows, R_r) * min(vocab, C_r) * itemsize``), and at
    most ``default``, the backend's own default. So the call never holds more transient logits
    than the path it replaces, and where that path's tile is large (thousands of rows) the
    backend keeps its large chunks (fast matmuls on the GPU).

    Args:
        rows: tokens the replaced path would receive (for a plain call: the counted rows).
        vocab: ``V``, rows of the lm_head weight.
        dtype: compute dtype of the logits (the input dtype, or autocast's).
        replaced: the replaced path's tile, e.g. :data:`TRL_LOGPROB`.
        default: the backend's default budget in bytes (> 0).

    Returns:
        Bytes of transient logits one chunk or tile may hold (>= 1).

    Source: tile shapes read from trl 1.16 ``kernels/chunked_logprob.py`` and
    ``trainer/utils.py``, trl 1.14 ``trainer/sft_trainer.py``.
    """
    return max(1, min(default, replaced.tile_bytes(rows, vocab, dtype)))
