"""TRL trainers compute with fused_ce_patch once the model is patched, with TRL's own loss and
metrics (needs ``trl``; CI runs this file under several TRL releases, see .ci/trl_matrix.sh).

Every comparison runs stock TRL and patched TRL from identical weights in float32, and checks
(1) a spy saw our kernel run, (2) the logged losses agree within 1e-5, (3) the logged metrics
(entropy, mean_token_accuracy, log-probs) agree within 1e-5.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; install trl to run this test")
datasets = pytest.importorskip("datasets")

from packaging.version import Version  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from fused_ce_patch import FusedCECallback, apply_fused_ce, fused_ce_config  # noqa: E402
from fused_ce_patch.hf import trl as trl_routing  # noqa: E402
from fused_ce_patch.hf.patch import is_fused_ce_applied  # noqa: E402
from hf_helpers import VOCAB, Spy, build_model, reference_copy  # noqa: E402

TRL = Version(trl.__version__)
HAS_FUSED_HEAD = TRL >= Version("1.15")  # add_fused_lm_head in every trainer
CHUNKED_DEFAULT = Version("1.7") <= TRL < Version("1.15")  # loss_type="chunked_nll" default
TOL = 1e-5


def _stock_head_runs_on_cpu() -> bool:
    """Whether TRL's fused-head kernel runs on CPU tensors here (trl 1.15 launches its Triton
    kernels on every device when Triton is importable, and they fail on CPU tensors)."""
    if not HAS_FUSED_HEAD:
        return True
    from trl.trainer.utils import _ChunkedLogProbFunction

    try:
        _ChunkedLogProbFunction.apply(torch.randn(2, 4), torch.randn(5, 4), None,
                                      torch.tensor([1, 3]), 1.0, 32768, None, 1.0,
                                      ("log_probs",))
    except Exception:  # noqa: BLE001 - whatever the failure, stock TRL cannot run here
        return False
    return True


STOCK_HEAD_ON_CPU = _stock_head_runs_on_cpu()
#: DPO, KTO, GRPO and RLOO also score an unpatched reference model, through TRL's own kernel:
#: on trl 1.15 that cannot run on CPU, with or without fused_ce_patch on the policy.
needs_trl_kernel_on_cpu = pytest.mark.skipif(
    not STOCK_HEAD_ON_CPU, reason=f"trl {TRL}'s own kernel (used for the reference model) has "
    "no CPU path")


class _MaterialisedLogProb:
    """TRL's fused-head kernel (``_ChunkedLogProbFunction.apply``, same arguments and results)
    from materialised float32 logits and autograd: the stock reference where TRL's own kernel
    cannot run on CPU (trl 1.15)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        z = (hidden @ weight.t()).float()
        if bias is not None:
            z = z + bias.float()
        z = z * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        z = z / temperature
        log_p = torch.log_softmax(z, -1)
        lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        sq = torch.logsumexp(2 * log_p, -1).detach() if "log_sum_sq_probs" in outputs else None
        mean = z.mean(-1).detach() if "mean_logits" in outputs else None
        top1 = (z.argmax(-1) == targets) if "is_top1" in outputs else None
        return lp, ent, sq, mean, top1


@contextlib.contextmanager
def _stock_head():
    """Stock TRL, with :class:`_MaterialisedLogProb` in place of TRL's kernel where that has
    no CPU path; TRL's object is back on exit."""
    if STOCK_HEAD_ON_CPU:
        yield
        return
    import trl.trainer.utils as utils_mod

    saved = utils_mod._ChunkedLogProbFunction
    utils_mod._ChunkedLogProbFunction = _MaterialisedLogProb
    try:
        yield
    finally:
        utils_mod._ChunkedLogProbFunction = saved


@pytest.fixture
def token_spy(monkeypatch):
    s = Spy(trl_routing.fused_linear_token_stats)
    monkeypatch.setattr(trl_routing, "fused_linear_token_stats", s)
    return s


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _common(tmp_path):
    # TRL configs turn bf16 on by default; float32 keeps the comparison exact.
    return dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                learning_rate=0.1, optim="sgd", bf16=False, report_to=[], use_cpu=True,
                logging_steps=1, save_strategy="no", seed=0)


def _history(trainer, keys):
    rows = [h for h in trainer.state.log_history if "loss" in h or any(k in h for k in keys)]
    return {k: torch.tensor([h[k] for h in rows if k in h], dtype=torch.float64)
            for k in keys if any(k in h for h in rows)}


def _assert_same_logs(got, want, keys):
    for k in keys:
        assert k in want, f"stock TRL {TRL} did not log {k!r}"
        assert k in got, f"patched run did not log {k!r}"
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=k)


def _sft_rows():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, VOCAB, (12,), generator=g).tolist()}
            for _ in range(4)]


def _sft(model, tmp_path, config_cls=None, callbacks=(), **extra):
    config_cls = config_cls or trl.SFTConfig
    args = config_cls(**{**_common(tmp_path), **extra})
    trainer = trl.SFTTrainer(model=model, args=args,
                             train_dataset=datasets.Dataset.from_list(_sft_rows()),
                             processing_class=_tokenizer(), callbacks=list(callbacks))
    trainer.train()
    return trainer


SFT_KEYS = ["loss", "entropy", "mean_token_accuracy"]
HAS_NLL = hasattr(trl.SFTConfig, "loss_type") or "loss_type" in trl.SFTConfig.__dataclass_fields__


@pytest.mark.parametrize("route,loss_type", [
    ("flag", None), ("callback", None), ("apply_first", None), ("flag", "nll"),
])
def test_sft_trains_with_our_kernel_and_same_metrics(route, loss_type, tmp_path, token_spy,
                                                     spy, caplog):
    extra = {} if loss_type is None else {"loss_type": loss_type}
    if loss_type is not None and not HAS_NLL:
        pytest.skip(f"trl {TRL} has no loss_type")
    if route == "apply_first" and not (HAS_FUSED_HEAD or CHUNKED_DEFAULT):
        pytest.skip("with loss_type='nll', TRL's metrics need the callback or the flag")
    init = build_model("llama")
    with _stock_head():
        want = _history(_sft(reference_copy(init), tmp_path / "stock", **extra), SFT_KEYS)
    assert token_spy.count == 0 and spy.count == 0
    model = reference_copy(init)
    if route == "flag":
        trainer = _sft(model, tmp_path / "ours", fused_ce_config(trl.SFTConfig),
                       use_fused_ce=True, **extra)
    elif route == "callback":
        trainer = _sft(model, tmp_path / "ours", callbacks=[FusedCECallback()], **extra)
    else:
        trainer = _sft(apply_fused_ce(model), tmp_path / "ours", **extra)
    assert is_fused_ce_applied(trainer.model)
    assert token_spy.count >= 2  # our kernel computed every training step
    # the router tells the kernel which tile TRL's own computation would hold (tile_policy)
    tiling = token_spy.calls[-1]["replaces"]
    if HAS_FUSED_HEAD:
        try:
            from trl.kernels import chunked_logprob

            rows = chunked_logprob.TOKEN_CHUNK_SIZE
        except ImportError:  # no Triton: TRL's kernel module cannot load; the policy's default
            from fused_ce_patch.tile_policy import TRL_LOGPROB

            rows = TRL_LOGPROB.rows
        assert (tiling.rows, tiling.cols, tiling.itemsize) == (rows, 32768, None)
    else:
        assert (tiling.rows, tiling.cols, tiling.itemsize) == (256, None, 4)
    assert "return_logits=True" not in caplog.text  # no advice to give up the fused path
    if HAS_FUSED_HEAD:  # recognised though trl 1.16 functools.wraps it as the class forward
        assert trl_routing.is_trl_head_forward(model.__dict__.get("forward"))
    _assert_same_logs(_history(trainer, SFT_KEYS), want, SFT_KEYS)
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce(model)
    converted = route != "apply_first" and not HAS_FUSED_HEAD and (
        loss_type == "nll" or not CHUNKED_DEFAULT)
    if converted:
        assert "forward" not in model.__dict__  # TRL's chunked head we added is gone


def test_revert_gives_trl_its_objects_back(tmp_path):
    model = build_model("llama")
    _sft(model, tmp_path, callbacks=[FusedCECallback()])
    if HAS_FUSED_HEAD or CHUNKED_DEFAULT:
        assert trl_routing.is_installed()
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce(model)
    assert not trl_routing.is_installed()
    import trl.trainer.sft_trainer as sft_mod

    assert not type(getattr(sft_mod, "_chunked_cross_entropy_loss", len)).__name__.startswith(
        "_Routed")
    if HAS_FUSED_HEAD:
        import trl.trainer.utils as utils_mod

        assert not isinstance(utils_mod._ChunkedLogProbFunction,
                              trl_routing._RoutedChunkedLogProb)


def test_unpatched_model_keeps_trl_kernel_while_another_is_patched(tmp_path, token_spy):
    from fused_ce_patch import revert_fused_ce

    with _stock_head():
        other = apply_fused_ce(build_model("llama"))  # keeps the routing alive
        _sft(build_model("llama"), tmp_path)
        assert token_spy.count == 0
        revert_fused_ce(other)  # the router holds TRL's object (or the stand-in) until then


def _dpo_rows():
    g = torch.Generator().manual_seed(1)

    def words(n):
        return " ".join(f"t{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())

    return [{"prompt": words(5), "chosen": " " + words(4), "rejected": " " + words(3)}
            for _ in range(4)]


def _dpo(model, ref, tmp_path, callbacks=(), config_cls=None, **extra):
    args = (config_cls or trl.DPOConfig)(**{**_common(tmp_path), "max_steps": 1, **extra})
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=datasets.Dataset.from_list(_dpo_rows()),
                             processing_class=_tokenizer(), callbacks=list(callbacks))
    trainer.train()
    return trainer


DPO_KEYS = ["loss", "logps/chosen", "logps/rejected", "rewards/margins"]


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason="DPO computes from logits before trl 1.15")
@needs_trl_kernel_on_cpu
def test_dpo_step_with_our_kernel(tmp_path, token_spy):
    init = build_model("llama")
    want = _history(_dpo(reference_copy(init), reference_copy(init), tmp_path / "s"), DPO_KEYS)
    assert token_spy.count == 0
    trainer = _dpo(reference_copy(init), reference_copy(init), tmp_path / "o",
                   [FusedCECallback()])
    assert token_spy.count > 0
    _assert_same_logs(_history(trainer, DPO_KEYS), want, DPO_KEYS)


def _grpo(model, tmp_path, callbacks=(), config_cls=None, **more):
    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    extra = {"max_steps": 1, "num_generations": 2, "max_completion_length": 4,
             "per_device_train_batch_size": 2, "generation_batch_size": 2, "beta": 0.1}
    args = (config_cls or trl.GRPOConfig)(**{**_common(tmp_path), **extra, **more})
    prompts = [{"prompt": "t5 t6 t7"}, {"prompt": "t8 t9"}]
    torch.manual_seed(0)  # same sampled completions in both runs
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_list(prompts),
                              processing_class=_tokenizer(), callbacks=list(callbacks))
    trainer.train()
    return trainer


GRPO_KEYS = ["loss", "entropy", "kl"]


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason="GRPO computes from logits before trl 1.15")
@needs_trl_kernel_on_cpu
def test_grpo_step_with_our_kernel(tmp_path, token_spy):
    from transformers import AutoModelForCausalLM

    # GRPO builds its reference model from the policy's path (beta > 0)
    build_model("llama").save_pretrained(tmp_path / "init")

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "init", dtype=torch.float32)

    want = _history(_grpo(load(), tmp_path / "s"), GRPO_KEYS)
    assert token_spy.count == 0
    trainer = _grpo(load(), tmp_path / "o", [FusedCECallback()])
    assert token_spy.count > 0
    _assert_same_logs(_history(trainer, GRPO_KEYS), want, GRPO_KEYS)


def _kto(model, ref, tmp_path, callbacks=(), config_cls=None, **extra):
    rows = _dpo_rows()
    data = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in rows for k in ("chosen", "rejected")]
    args = (config_cls or trl.KTOConfig)(**{**_common(tmp_path), "max_steps": 1,
                                            "per_device_train_batch_size": 4, **extra})
    trainer = trl.KTOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=datasets.Dataset.from_list(data),
                             processing_class=_tokenizer(), callbacks=list(callbacks))
    trainer.train()
    return trainer


KTO_KEYS = ["loss", "kl", "entropy", "logps/chosen", "logps/rejected"]


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason="KTO computes from logits before trl 1.15")
@needs_trl_kernel_on_cpu
def test_kto_step_with_our_kernel(tmp_path, token_spy):
    init = build_model("llama")
    want = _history(_kto(reference_copy(init), reference_copy(init), tmp_path / "s"), KTO_KEYS)
    assert token_spy.count == 0
    trainer = _kto(reference_copy(init), reference_copy(init), tmp_path / "o",
                   [FusedCECallback()])
    assert token_spy.count > 0
    keys = [k for k in KTO_KEYS if k in want]
    assert "loss" in keys and "kl" in keys
    _assert_same_logs(_history(trainer, keys), want, keys)


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason="RLOO computes from logits before trl 1.15")
@needs_trl_kernel_on_cpu
def test_rloo_step_with_our_kernel(tmp_path, token_spy):
    from transformers import AutoModelForCausalLM

    build_model("llama").save_pretrained(tmp_path / "init")

    def run(out, callbacks=()):
        def reward(completions, **kwargs):
            return [float(len(c)) for c in completions]

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "init", dtype=torch.float32)
        args = trl.RLOOConfig(**{**_common(out), "max_steps": 1, "num_generations": 2,
                                 "max_completion_length": 4, "generation_batch_size": 2,
                                 "beta": 0.1})
        torch.manual_seed(0)
        trainer = trl.RLOOTrainer(model=model, reward_funcs=reward, args=args,
                                  train_dataset=datasets.Dataset.from_list(
                                      [{"prompt": "t5 t6 t7"}, {"prompt": "t8 t9"}]),
                                  processing_class=_tokenizer(), callbacks=list(callbacks))
        trainer.train()
        return trainer

    keys = ["loss", "entropy", "kl"]
    want = _history(run(tmp_path / "s"), keys)
    trainer = run(tmp_path / "o", [FusedCECallback()])
    assert token_spy.count > 0
    _assert_same_logs(_history(trainer, keys), want, keys)


def test_sft_evaluate_loss_and_metrics_match_stock(tmp_path, token_spy):
    init = build_model("llama")

    def run(model, out, callbacks=()):
        args = trl.SFTConfig(**{**_common(out), "per_device_eval_batch_size": 2})
        trainer = trl.SFTTrainer(model=model, args=args,
                                 train_dataset=datasets.Dataset.from_list(_sft_rows()),
                                 eval_dataset=datasets.Dataset.from_list(_sft_rows()),
                                 processing_class=_tokenizer(), callbacks=list(callbacks))
        return trainer.evaluate()

    with _stock_head():
        want = run(reference_copy(init), tmp_path / "s")
    got = run(reference_copy(init), tmp_path / "o", [FusedCECallback()])
    for k in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        if k in want:
            assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), k
    assert "eval_loss" in got
    if HAS_FUSED_HEAD or CHUNKED_DEFAULT:
        assert token_spy.count > 0  # TRL's head evaluates through our kernel


@pytest.mark.skipif(HAS_FUSED_HEAD, reason="trl >= 1.15 needs no conversion")
def test_nll_with_compute_metrics_keeps_logits_path_and_warns(tmp_path, caplog):
    args = trl.SFTConfig(**_common(tmp_path), loss_type="nll")
    model = build_model("llama")
    with caplog.at_level("WARNING", logger="fused_ce_patch.hf.trl"):
        trl.SFTTrainer(model=model, args=args,
                       train_dataset=datasets.Dataset.from_list(_sft_rows()),
                       processing_class=_tokenizer(), callbacks=[FusedCECallback()],
                       compute_metrics=lambda p: {})
    assert "return_logits=True" in caplog.text
    assert not trl_routing.is_trl_head_forward(model.__dict__.get("forward"))


@pytest.mark.skipif(HAS_FUSED_HEAD, reason="trl >= 1.15 needs no conversion")
def test_nll_on_a_head_with_a_transform_keeps_trls_head_off_and_warns(tmp_path, caplog):
    # TRL's chunked_nll head would multiply the backbone's hidden states by the decoder
    # weight, skipping RoBERTa's dense + layer norm: a number stock never gives
    from transformers import RobertaConfig, RobertaForCausalLM

    config = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=64, is_decoder=True,
                           pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = RobertaForCausalLM(config)
    args = trl.SFTConfig(**_common(tmp_path), loss_type="nll")
    with caplog.at_level("WARNING", logger="fused_ce_patch.hf.trl"):
        trl.SFTTrainer(model=model, args=args,
                       train_dataset=datasets.Dataset.from_list(_sft_rows()),
                       processing_class=_tokenizer(), callbacks=[FusedCECallback()])
    assert "transform before its vocabulary projection" in caplog.text
    assert not trl_routing.is_trl_head_forward(model.__dict__.get("forward"))


def test_forward_calls_projection_tells_transform_heads_apart():
    from transformers import RobertaConfig, RobertaForCausalLM

    roberta = RobertaForCausalLM(RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, is_decoder=True))
    llama = build_model("llama")
    assert not trl_routing._forward_calls_projection(roberta, roberta.get_output_embeddings())
    assert trl_routing._forward_calls_projection(llama, llama.get_output_embeddings())


def _chunked_nll_trl(monkeypatch):
    """TRL as 1.6-1.14 was, for :func:`convert_nll_sft_trainer`: no ``add_fused_lm_head``, and
    a ``_patch_chunked_ce_lm_head`` (a recorder here) in ``sft_trainer``; returns its calls."""
    import trl.trainer.sft_trainer as sft_mod
    import trl.trainer.utils as utils_mod

    calls = []
    monkeypatch.setattr(utils_mod, "add_fused_lm_head", None, raising=False)
    monkeypatch.setattr(sft_mod, "_patch_chunked_ce_lm_head",
                        lambda model, chunk_size, is_vlm: calls.append(model), raising=False)
    return calls


def _nll_sft_trainer():
    """An ``SFTTrainer`` as ``on_init_end`` sees one with ``loss_type="nll"`` and nothing that
    keeps TRL's chunked head off (no ``__init__``: only the fields the conversion reads)."""
    import types

    trainer = trl.SFTTrainer.__new__(trl.SFTTrainer)
    trainer.args = types.SimpleNamespace(loss_type="nll", use_liger_kernel=False)
    trainer.compute_loss_func = trainer.label_smoother = None
    trainer.compute_metrics = trainer.preprocess_logits_for_metrics = None
    return trainer


def test_nll_conversion_installs_trls_chunked_head_on_a_plain_head(monkeypatch):
    """The control of the test below: the simulated older TRL reaches the head's install."""
    calls = _chunked_nll_trl(monkeypatch)
    model = build_model("llama")
    trainer = _nll_sft_trainer()
    assert trl_routing.convert_nll_sft_trainer(trainer, model) is not None
    assert calls == [model] and "compute_loss" in trainer.__dict__


@pytest.mark.parametrize("head", ["raises", "none"])
def test_nll_conversion_steps_aside_when_the_head_cannot_be_read(head, monkeypatch, caplog):
    """A model whose get_output_embeddings() raises (NotImplementedError: a class that never
    defined it) or returns None gets no TRL head and no warning from this step: nothing is
    installed, and apply_fused_ce refuses that model itself, saying why."""
    calls = _chunked_nll_trl(monkeypatch)
    model = build_model("llama")

    def get_output_embeddings():
        if head == "raises":
            raise NotImplementedError("no output embeddings here")
        return None

    monkeypatch.setattr(model, "get_output_embeddings", get_output_embeddings)
    trainer = _nll_sft_trainer()
    with caplog.at_level("WARNING", logger="fused_ce_patch.hf.trl"):
        assert trl_routing.convert_nll_sft_trainer(trainer, model) is None
    assert calls == [] and "compute_loss" not in trainer.__dict__
    assert "forward" not in model.__dict__
    assert caplog.records == []


@pytest.mark.skipif(STOCK_HEAD_ON_CPU, reason="TRL's own head runs on CPU here (trl != 1.15)")
def test_trl_head_without_a_cpu_path_fails_stock_and_trains_patched(tmp_path, token_spy):
    # trl 1.15 launches Triton kernels on CPU tensors: stock SFT cannot train on CPU, a
    # model patched by fused_ce_patch trains (its kernel runs instead of TRL's)
    init = build_model("llama")
    with pytest.raises(Exception):  # noqa: B017 - whatever Triton raises on CPU tensors
        _sft(reference_copy(init), tmp_path / "stock")
    assert token_spy.count == 0
    trainer = _sft(reference_copy(init), tmp_path / "ours", callbacks=[FusedCECallback()])
    assert token_spy.count >= 2
    losses = _history(trainer, ["loss"])["loss"]
    assert losses.numel() >= 1 and torch.isfinite(losses).all()


# -- the flag with TRL's default precision (bf16) ----------------------------------------------
#: bf16 autocast rounds every logit to 8 significant bits (relative 2**-8); TRL's kernel and
#: ours tile and accumulate differently, so logged values agree to a few bf16 ulps of their
#: size, not to float32 rounding. A loss scaled by (T-1)/T, a skipped step or a metric off by
#: a token is still far outside this.
BF16_TOL = 4 * 2.0 ** -8


def _assert_close_bf16(got, want, keys):
    for k in keys:
        assert k in want and k in got, k
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=BF16_TOL, atol=BF16_TOL, msg=k)


@pytest.mark.parametrize("kind", ["sft", "sft_fp16", "dpo", "kto", "grpo"])
def test_flag_with_bf16_trains_with_our_kernel_like_stock_bf16(kind, tmp_path, token_spy,
                                                               caplog):
    # TRL's configs default to bf16=True: accelerate's autocast wrapper then wraps TRL's fused
    # head, which wraps our forward; train-begin's check must look through it (issue 38.1).
    # fp16 (CPU autocast float16) takes the same wrapper.
    if kind.startswith("sft"):
        precision = {"bf16": False, "fp16": True} if kind == "sft_fp16" else {"bf16": True}
        init = build_model("llama")
        with _stock_head():
            want = _history(_sft(reference_copy(init), tmp_path / "s", **precision), SFT_KEYS)
        with caplog.at_level("WARNING", logger="fused_ce_patch"):
            trainer = _sft(reference_copy(init), tmp_path / "o", fused_ce_config(trl.SFTConfig),
                           use_fused_ce=True, **precision)
        keys = SFT_KEYS
    else:
        if not HAS_FUSED_HEAD:
            pytest.skip(f"{kind.upper()} computes from logits before trl 1.15")
        if not STOCK_HEAD_ON_CPU:
            pytest.skip(f"trl {TRL}'s own kernel (reference model) has no CPU path")
        if kind == "grpo":
            from transformers import AutoModelForCausalLM

            build_model("llama").save_pretrained(tmp_path / "init")

            def load():
                return AutoModelForCausalLM.from_pretrained(tmp_path / "init",
                                                            dtype=torch.float32)

            want = _history(_grpo(load(), tmp_path / "s", bf16=True), GRPO_KEYS)
            with caplog.at_level("WARNING", logger="fused_ce_patch"):
                trainer = _grpo(load(), tmp_path / "o", config_cls=fused_ce_config(
                    trl.GRPOConfig), use_fused_ce=True, bf16=True)
            keys = GRPO_KEYS
        else:
            run, cfg, keys = {"dpo": (_dpo, trl.DPOConfig, DPO_KEYS),
                              "kto": (_kto, trl.KTOConfig, ["loss", "kl", "logps/chosen"])}[kind]
            init = build_model("llama")
            want = _history(run(reference_copy(init), reference_copy(init), tmp_path / "s",
                                bf16=True), keys)
            with caplog.at_level("WARNING", logger="fused_ce_patch"):
                trainer = run(reference_copy(init), reference_copy(init), tmp_path / "o",
                              config_cls=fused_ce_config(cfg), use_fused_ce=True, bf16=True)
    assert token_spy.count > 0  # our kernel computed the steps
    assert is_fused_ce_applied(trainer.model)
    assert "not patched at train begin" not in caplog.text
    _assert_close_bf16(_history(trainer, keys), want, keys)


# -- import order (issue 38.5) ----------------------------------------------------------------

_IMPORT_ORDER_SCRIPT = r"""
import sys
if sys.argv[1] == "after_trl":
    import trl  # trl loads its trainer modules lazily: trl.trainer.utils is not imported yet
    assert "trl.trainer.utils" not in sys.modules
sys.path.insert(0, sys.argv[2])
import torch
from hf_helpers import build_model
from fused_ce_patch import apply_fused_ce, revert_fused_ce
from fused_ce_patch.hf import trl as R

model = apply_fused_ce(build_model("llama"))
from trl import SFTTrainer  # noqa: F401 - imports trl.trainer.utils now
import trl.trainer.utils as U

calls = []
real = R.fused_linear_token_stats
R.fused_linear_token_stats = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
h = torch.randn(3, model.config.hidden_size)
out = U._ChunkedLogProbFunction.apply(h, model.lm_head.weight, None, torch.tensor([1, 2, 3]),
                                      1.0, 32768, None, 1.0, ("log_probs",))
want = torch.log_softmax(h @ model.lm_head.weight.t(), -1)[torch.arange(3), [1, 2, 3]]
assert calls, "TRL's kernel ran, not ours"
torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
try:  # trl >= 1.16: DistillationTrainer's loss, imported after the patch too
    import trl.trainer.distillation_trainer as D
except ImportError:
    D = None
if D is not None:
    assert D._chunked_divergence_loss.__module__ == "fused_ce_patch.hf.trl", "not routed"
revert_fused_ce(model)
assert not isinstance(U._ChunkedLogProbFunction, R._RoutedChunkedLogProb)
if D is not None:
    assert D._chunked_divergence_loss.__module__.startswith("trl."), "not restored"
assert R._HOOK not in sys.meta_path
print("ok")
"""


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason="routes add_fused_lm_head's kernel (trl >= 1.15)")
@pytest.mark.parametrize("order", ["after_trl", "before_trl"])
def test_routing_installed_whatever_the_import_order(order, tmp_path):
    # apply_fused_ce before TRL's trainer modules are imported (issue 38.5): their router is
    # installed when they are imported; the import hook goes away with the last patch
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).parent
    script = tmp_path / "order.py"
    script.write_text(_IMPORT_ORDER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here.parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), order, str(here)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
