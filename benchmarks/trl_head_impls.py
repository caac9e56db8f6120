"""The per-token implementations compared by gpu_trl_head.py (and gpu_bench.py's trl-head peer).

``build(torch, impl, softcap)`` returns ``fn(hidden, weight, labels) -> loss``: TRL 1.16's fused
LM head (``trl.kernels.ChunkedLogProbFunction``) or ``fused_linear_token_stats`` computing the
same outputs (SFT: log-probs, entropy, top-1; GRPO: per-token weights), and the plain fused loss.
Kept apart from both scripts so that neither imports the other.

TRL's backward imports ``maybe_gather_lm_head_ctx`` from ``trl.trainer.utils``, which imports
``datasets`` (and pandas, pyarrow: ~60 MB of wheels the GPU machine lacks). Where that import
fails, :func:`_trl_utils_stand_in` registers a module with that one function as TRL defines it
without DeepSpeed ZeRO-3 (a null context), which is what it returns on one GPU.
"""

from __future__ import annotations

IMPLS = ["trl-sft", "trl-logp", "trl-grpo", "ours-sft", "ours-logp", "ours-grpo",
         "ours-sft-tiles", "ours-loss"]
TRL_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (trl 1.16)


def _weights(torch, labels, grpo):
    """Per-token weights of the log-probabilities: 1, or fixed values in [-1, 1] (GRPO)."""
    if not grpo:
        return None
    g = torch.Generator(device=labels.device).manual_seed(7)
    return torch.rand(labels.shape, generator=g, device=labels.device) * 2 - 1


def reference_weighted(torch, data, softcap):
    """float32 ``-sum(w * log p_y) / n_counted`` with the *-grpo weights, and its dH, dW."""
    h = data["hidden"].float().requires_grad_()
    w = data["weight"].float().requires_grad_()
    labels = data["labels"]
    z = h @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    mask = labels != -100
    lp = torch.log_softmax(z, -1).gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    loss = -(lp * _weights(torch, labels, True) * mask).sum() / mask.sum()
    dh, dw = torch.autograd.grad(loss, [h, w])
    del z, lp
    return {"loss": loss.detach(), "dh": dh, "dw": dw}


def _trl_utils_stand_in():
    """Make ``from trl.trainer.utils import maybe_gather_lm_head_ctx`` work without datasets."""
    import contextlib
    import sys
    import types

    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError as exc:
        stand_in = types.ModuleType("trl.trainer.utils")
        stand_in.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stand_in
        print(f"trl.trainer.utils stand-in (no ZeRO-3 gather): {exc}", file=sys.stderr)


def datasets_stand_in():
    """Let TRL's trainer modules import where ``datasets`` is not installed (the GPU machine):
    a module whose every attribute is an empty class. Only functions that never touch a
    dataset (``distillation_trainer._chunked_divergence_loss``) may be called then."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("datasets") is not None:
        return

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {})
            setattr(self, name, value)
            return value

    module = StandIn("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    module.__version__ = "0.0"
    sys.modules["datasets"] = module
    print("datasets stand-in: TRL's trainer modules import without datasets", file=sys.stderr)


def build(torch, impl, softcap):
    sft = ("log_probs", "entropy", "is_top1")
    grpo = impl.endswith("-grpo")
    if impl.startswith("trl"):
        from trl.kernels import ChunkedLogProbFunction

        _trl_utils_stand_in()
        outputs = ("log_probs",) if impl == "trl-logp" else sft

        def trl_head(hidden, weight, labels):
            mask = labels != -100  # TRL's head scores the counted rows only (on CUDA)
            lp = ChunkedLogProbFunction.apply(hidden[mask], weight, None, labels[mask], 1.0,
                                              TRL_CHUNK, softcap, 1.0, outputs)[0]
            w = _weights(torch, labels, grpo)
            lp = lp if w is None else lp * w[mask]
            return -lp.sum() / mask.sum().clamp(min=1)

        return trl_head
    if impl in ("ours-sft", "ours-logp", "ours-grpo", "ours-sft-tiles"):
        from fused_ce_patch import ForwardGradHint, fused_linear_token_stats

        full = impl != "ours-logp"
        hint = None if impl == "ours-logp" else ForwardGradHint()
        backend = "torch" if impl.endswith("-tiles") else "auto"

        def ours(hidden, weight, labels):
            s = fused_linear_token_stats(hidden, weight, labels, softcap=softcap,
                                         entropy=full, accuracy=full, backend=backend,
                                         grad_hint=hint)
            w = _weights(torch, labels, grpo)
            lp = s.log_probs if w is None else s.log_probs * w
            return -lp.sum() / s.mask.sum().clamp(min=1)

        return ours
    if impl == "ours-loss":
        from fused_ce_patch import fused_linear_cross_entropy

        return lambda hd, w, y: fused_linear_cross_entropy(hd, w, y, softcap=softcap)
    raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")
