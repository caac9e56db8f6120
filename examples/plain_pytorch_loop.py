"""Your own PyTorch loop calling ``fused_linear_cross_entropy`` directly: no Trainer, no patch.

    python examples/plain_pytorch_loop.py [--steps 3] [--seq-len 64] [--batch-size 2] [--data FILE]

Run the decoder (``model.model``) for the last hidden states and hand them, the lm_head weight
and the labels to the loss; ``shift=True`` makes position t predict label t+1 as a causal LM
does. The ``[tokens, vocab]`` logits never exist. The first step is checked against the stock
``model(..., labels=...).loss``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fused_ce_patch import fused_linear_cross_entropy
from fused_ce_patch.demo.data import DataError, pack_blocks, read_texts
from fused_ce_patch.demo import local_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", help="training text: a .txt or .jsonl file or a directory of "
                        "text files (default: the demo's text)")
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()
    try:
        texts = read_texts(args.data)
    except DataError as exc:
        parser.error(str(exc))  # one line, exit status 2

    torch.manual_seed(0)
    model_dir = local_model_path("smollm2")  # real weights, offline
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    blocks = pack_blocks(tokenizer, texts, args.seq_len, args.steps * args.batch_size)
    for step, input_ids in enumerate(blocks.split(args.batch_size), 1):
        hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, H]
        loss = fused_linear_cross_entropy(
            hidden,
            model.lm_head.weight,  # [V, H]; tied to the embedding in SmolLM2
            input_ids,  # labels = the input ids ...
            shift=True,  # ... so shift=True is REQUIRED: position t predicts token t+1
            # (without it the call is a different loss, predicting each token from itself).
        )
        if step == 1:
            with torch.no_grad():
                stock = model(input_ids=input_ids, labels=input_ids).loss
            rel = abs(loss.item() - stock.item()) / stock.item()
            print(f"step 1: fused {loss.item():.6f}, stock {stock.item():.6f} (rel. {rel:.1e})")
            if rel > 1e-5:
                raise SystemExit("fused loss differs from the stock loss")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}/{args.steps}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
