"""Liger-Kernel's non-loss kernels (RMSNorm, RoPE, SwiGLU) with fused_ce_patch's loss.

    python examples/liger_combo.py [--steps 2] [--seq-len 64] [--data FILE]

Needs ``pip install liger-kernel`` (0.8.x). Liger's kernels are Triton: on a CUDA GPU all
three run; on a CPU this script runs them under the Triton interpreter (``TRITON_INTERPRET=1``,
set here before Liger is imported), where liger-kernel 0.8.5's RoPE works but its RMSNorm and
SwiGLU kernels do not, so the CPU run uses RoPE alone.

The recipe: Liger with ``fused_linear_cross_entropy=False`` (Liger's loss kernel replaces the
forward that fused_ce_patch patches; two fused losses cannot share it), then
``apply_fused_ce(model)``; the order of the two calls does not matter. The script checks the
first step's loss against the same model with the same Liger kernels and transformers' own
loss, trains a few steps, then shows the error you get with Liger's loss kernel left on.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede importing Liger: @triton.jit reads it when a kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: E402
except ImportError as exc:  # optional (with the triton it requires): one line, exit status 2
    print(f"examples/liger_combo.py needs liger-kernel: pip install 'liger-kernel>=0.8.5,<0.9' "
          f"({exc})", file=sys.stderr)
    sys.exit(2)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fused_ce_patch import UnsupportedModelError, apply_fused_ce  # noqa: E402
from fused_ce_patch.demo import local_model_path  # noqa: E402
from fused_ce_patch.demo.data import DataError, pack_blocks, read_texts  # noqa: E402
from fused_ce_patch.hf import loss_mapping  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", help="training text: a .txt or .jsonl file or a directory of "
                        "text files (default: the demo's text)")
    args = parser.parse_args()
    try:
        texts = read_texts(args.data)
    except DataError as exc:
        parser.error(str(exc))  # one line, exit status 2

    device = "cuda" if CUDA else "cpu"
    model_dir = local_model_path("smollm2")  # real weights, offline (a Llama architecture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    reference = copy.deepcopy(model)  # same weights: Liger's kernels, transformers' loss
    reference.loss_function = loss_mapping.original_causal_lm_loss()

    kernels = dict(rope=True, rms_norm=CUDA, swiglu=CUDA)
    for m in (model, reference):
        apply_liger_kernel_to_llama(**kernels, cross_entropy=False,
                                    fused_linear_cross_entropy=False,  # <- the one rule
                                    model=m)
    apply_fused_ce(model)  # before or after Liger: either order works
    on = ", ".join(k for k, v in kernels.items() if v)
    print(f"Liger kernels on: {on}; loss: fused_ce_patch ({device})")

    blocks = pack_blocks(tokenizer, texts, args.seq_len, 2 * (args.steps + 1)).to(device)
    first, rest = blocks[:2], blocks[2:]
    ours = model(input_ids=first, labels=first).loss
    theirs = reference(input_ids=first, labels=first).loss
    rel = abs(ours.item() - theirs.item()) / theirs.item()
    print(f"loss fused_ce_patch {ours.item():.6f}  transformers {theirs.item():.6f}  "
          f"relative difference {rel:.1e}")
    if rel > 1e-5:
        raise SystemExit("the losses differ")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for step, batch in enumerate(rest.split(2), 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}/{args.steps}  loss {loss.item():.4f}")

    # The pitfall: Liger's own fused loss (its default) replaces the forward we patch.
    other = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False,
                                fused_linear_cross_entropy=True, model=other)
    try:
        apply_fused_ce(other)
    except UnsupportedModelError as error:
        print(f"with Liger's fused_linear_cross_entropy on: {error}")


if __name__ == "__main__":
    main()
