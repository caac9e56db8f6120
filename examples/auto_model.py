"""Load an already patched model with ``AutoFusedCEForCausalLM``; train a step, then generate.

    python examples/auto_model.py [--seq-len 64] [--data FILE]

``AutoFusedCEForCausalLM.from_pretrained`` takes exactly ``AutoModelForCausalLM``'s arguments
and returns the same transformers class, patched. The fused path is taken only for a training
forward with labels; evaluation, ``generate()`` and calls without labels are the stock ones.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fused_ce_patch import AutoFusedCEForCausalLM, LogitsNotMaterializedError
from fused_ce_patch.numerics import relative_error
from fused_ce_patch.demo.data import DataError, pack_blocks, read_texts
from fused_ce_patch.demo import local_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", help="training text: a .txt or .jsonl file or a directory of "
                        "text files (default: the demo's text)")
    args = parser.parse_args()
    try:
        texts = read_texts(args.data)
    except DataError as exc:
        parser.error(str(exc))  # one line, exit status 2

    model_dir = local_model_path("smollm2")  # real weights, offline
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoFusedCEForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    print(f"{type(model).__name__} loaded, patched")

    batch = pack_blocks(tokenizer, texts, args.seq_len, 2)

    # One training step's loss and lm_head gradient, fused vs stock.
    model.train()
    stock.train()
    fused_out = model(input_ids=batch, labels=batch)
    fused_out.loss.backward()
    stock_out = stock(input_ids=batch, labels=batch)
    stock_out.loss.backward()
    grad_f = model.get_output_embeddings().weight.grad
    grad_s = stock.get_output_embeddings().weight.grad
    rel = relative_error(grad_f, grad_s)
    print(f"loss fused {fused_out.loss.item():.6f}  stock {stock_out.loss.item():.6f}")
    print(f"lm_head gradient, relative difference: {rel:.1e}")

    # The training output has no logits to read; it says so instead of failing later.
    try:
        fused_out.logits.softmax(-1)
    except LogitsNotMaterializedError as error:
        print(f"as documented, logits were not materialised: {type(error).__name__}")

    # Generation is the stock path: identical tokens.
    model.eval()
    stock.eval()
    prompt = tokenizer("The licence grants you the right to", return_tensors="pt")
    with torch.no_grad():
        ours = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        theirs = stock.generate(**prompt, max_new_tokens=12, do_sample=False)
    print("generated:", tokenizer.decode(ours[0], skip_special_tokens=True))
    if not torch.equal(ours, theirs):
        raise SystemExit("generate() differs from the stock model")
    print("generate() identical to the stock model")


if __name__ == "__main__":
    main()
