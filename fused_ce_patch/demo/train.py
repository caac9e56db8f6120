"""One fine-tuning run with transformers' Trainer, fused or stock, measured from inside.

The demo starts this module once per run in a fresh process
(``python -m fused_ce_patch.demo.train CONFIG.json``) so that each run's peak memory is its own.
A run loads the cached model, optionally applies :func:`fused_ce_patch.apply_fused_ce`, trains
on the token blocks the parent prepared (identical for both runs, fed in order), and writes a
JSON report: the exact loss of every step, step times, resident memory before training and its
peak during training, and whether the model's output held real logits.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import memory


@dataclass
class RunConfig:
    """Everything one run needs; written to JSON by the parent.

    Attributes:
        model_dir: a Hugging Face model directory (see ``models.resolve_model``).
        blocks_file: ``torch.save``'d ``[steps * batch_size, seq_len]`` int64 token ids.
        fused: apply the fused loss (True) or train the stock model (False).
        backend: ``backend=`` for the fused loss (``"auto"``, ``"torch"``, ...).
        steps: optimizer steps.
        batch_size: rows per step.
        learning_rate: AdamW learning rate (constant schedule).
        seed: seed for torch and Trainer.
        report: where to write the JSON report.
    """

    model_dir: str
    blocks_file: str
    fused: bool
    backend: str = "auto"
    steps: int = 10
    batch_size: int = 2
    learning_rate: float = 2e-5
    seed: int = 0
    report: str = ""


class BlockDataset(torch.utils.data.Dataset):
    """Rows of packed token ids as causal-LM examples: labels = input ids (the model shifts
    them); packed text has no padding, so every position counts."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _training_arguments(config: RunConfig, output_dir: str):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=1,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=config.seed,
        data_seed=config.seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    # Same order in both runs; "sequential" makes it plain (transformers >= 5.2x has it).
    if "train_sampling_strategy" in fields:
        kwargs["train_sampling_strategy"] = "sequential"
    return TrainingArguments(**kwargs)


def _make_trainer(model, args, dataset):
    """A Trainer that records each step's exact loss, time, and whether logits were real."""
    from transformers import Trainer, TrainerCallback, default_data_collator

    class Timer(TrainerCallback):
        """Wall and CPU time of each optimizer step (CPU time is this process's, all threads)."""

        def __init__(self):
            self.start = (0.0, 0.0)
            self.times, self.cpu_times = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start[0])
            self.cpu_times.append(time.process_time() - self.start[1])

    class RecordingTrainer(Trainer):
        step_losses: list[float]
        logits_kinds: set[str]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            # type() only: the fused path's sentinel raises if used as a tensor.
            logits = outputs.get("logits") if hasattr(outputs, "get") else None
            self.logits_kinds.add(type(logits).__name__)
            # Drop the outputs now, as the stock compute_loss does, so the stock run's logits
            # are not kept alive through backward by this measurement.
            del outputs, logits
            return (loss, None) if return_outputs else loss

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.step_losses.append(float(loss))
            return loss

    timer = Timer()
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[timer],
    )
    trainer.step_losses = []
    trainer.logits_kinds = set()
    return trainer, timer


def make_resident(model: torch.nn.Module) -> None:
    """Give every parameter and buffer its own anonymous memory.

    ``from_pretrained`` memory-maps safetensors files: the weights stay file-backed and
    page in on first touch, so the first forward would count the whole model as training
    memory, and the first optimizer step copies each page again (copy-on-write) while the file
    pages may stay resident. Private copies made before measuring keep both runs honest.
    Tied weights stay tied (each shared Parameter is visited once and keeps its identity).
    """
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()
    gc.collect()


def run(config: RunConfig) -> dict:
    """Train as ``config`` says, in this process, and return the report (also written to
    ``config.report`` when set)."""
    from transformers import AutoModelForCausalLM, set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    set_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=torch.float32)
    make_resident(model)
    backend_name = None
    if config.fused:
        from fused_ce_patch import apply_fused_ce
        from fused_ce_patch.backends import resolve

        options = {} if config.backend == "auto" else {"backend": config.backend}
        apply_fused_ce(model, **options)
        backend_name = resolve(config.backend, torch.device("cpu"), torch.float32).name

    blocks = torch.load(config.blocks_file)
    dataset = BlockDataset(blocks)
    with tempfile.TemporaryDirectory(prefix="fused_ce_demo_") as out:
        args = _training_arguments(config, out)
        trainer, timer = _make_trainer(model, args, dataset)
        gc.collect()
        load_before = os.getloadavg()[0]
        rss_before = memory.current_rss()
        exact_peak = memory.reset_peak()
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        peak = memory.peak_rss()
        load_after = os.getloadavg()[0]

    tokens_per_step = config.batch_size * blocks.shape[1]
    # The median step: robust to the odd step slowed by other work on a shared CPU.
    step_time = statistics.median(timer.times) if timer.times else math.nan
    report = {
        "fused": config.fused,
        "backend": backend_name,
        "losses": trainer.step_losses,
        "step_times_s": timer.times,
        "step_cpu_times_s": timer.cpu_times,
        "cpu_s_per_step": statistics.median(timer.cpu_times) if timer.cpu_times else math.nan,
        "train_wall_s": wall,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_time if step_time else math.nan,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "peak_is_training_only": exact_peak,
        "logits_types": sorted(trainer.logits_kinds),
        "torch_threads": torch.get_num_threads(),
        # Other processes on the machine slow a CPU run down; the load average says how busy.
        "load_average": [load_before, load_after],
    }
    if config.report:
        Path(config.report).write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m fused_ce_patch.demo.train CONFIG.json``: one run, report to ``config.report``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fused_ce_patch.demo.train CONFIG.json", file=sys.stderr)
        return 2
    config = RunConfig(**json.loads(Path(argv[0]).read_text()))
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
