"""LoRA fine-tuning through PEFT with the fused loss: ``apply_fused_ce`` on the PEFT model.

    python examples/peft_lora.py [--steps 3] [--seq-len 64] [--batch-size 2] [--data FILE]

Needs PEFT (``pip install 'fused_ce_patch[peft]'``; the ``[demo]`` and ``[test]`` extras include
it).

``apply_fused_ce`` looks through the ``PeftModel`` to the causal LM inside and patches that
instance (before or after ``get_peft_model``, either order works). LoRA here adapts the
attention projections; the lm_head stays frozen and the fused loss reads its weight through
the module that owns it. Training uses an ordinary ``Trainer`` (no flag needed once patched).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

try:
    from peft import LoraConfig, get_peft_model
except ImportError:  # an optional dependency of fused_ce_patch: one line, exit status 2
    print("examples/peft_lora.py needs PEFT: pip install 'fused_ce_patch[peft]'", file=sys.stderr)
    sys.exit(2)

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from fused_ce_patch import apply_fused_ce
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

    model_dir = local_model_path("smollm2")  # real weights, offline
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    apply_fused_ce(model)  # patches the LlamaForCausalLM inside the PeftModel
    model.print_trainable_parameters()

    blocks = pack_blocks(tokenizer, texts, args.seq_len, args.steps * args.batch_size)
    dataset = [{"input_ids": row, "labels": row} for row in blocks]
    lora_b_before = {
        name: p.detach().clone() for name, p in model.named_parameters() if "lora_B" in name
    }

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=dataset,
            data_collator=default_data_collator,
        )
        result = trainer.train()

    # LoRA's B matrices start at zero; the adapters trained if they moved.
    moved = sum(
        not torch.equal(p.detach(), lora_b_before[name])
        for name, p in model.named_parameters()
        if "lora_B" in name
    )
    print(f"training loss over {args.steps} steps: {result.training_loss:.4f}")
    print(f"LoRA B matrices updated: {moved} of {len(lora_b_before)}")
    if moved != len(lora_b_before):
        raise SystemExit("some LoRA adapters did not train")


if __name__ == "__main__":
    main()
