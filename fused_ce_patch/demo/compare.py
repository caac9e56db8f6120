"""``python -m fused_ce_patch demo``: fine-tune a real model fused, then stock, and compare.

The parent process prepares everything both runs share — the cached model directory and the
token blocks, saved once so both runs see the same rows in the same order — then starts
:mod:`fused_ce_patch.demo.train` twice, each in a fresh process (first with the fused loss, then
the stock model from the same weights and seed), streaming their progress bars, and finally
prints one side-by-side table: the loss of every step, peak resident memory, CPU time per
step, and (uncompared, since it follows machine load) tokens/s.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import data, models
from .train import RunConfig

MIB = 2**20

#: Per-step relative loss difference accepted as "equal within float32 tolerance". The first
#: step sees identical weights, and the difference is mostly stock's own float32 rounding,
#: which grows with the vocabulary (measured against float64: the fused loss is within ~3e-8,
#: stock within 3e-6 at 49152 logits; fused vs stock 6e-6 at 262144). Later steps start from
#: weights that differ by the rounding of earlier updates, which AdamW amplifies where a
#: gradient is near zero, so more is allowed (measured: <= 2e-5 at the default learning rate).
FIRST_STEP_RTOL = 2e-5
LATER_STEP_RTOL = 1e-4


@dataclass
class DemoOptions:
    """The demo's command-line options (see ``python -m fused_ce_patch demo --help``)."""

    # Defaults chosen so that the saving is plain to see in about 3 minutes on 2 cores: the
    # saving is the stock step's logits, tokens x vocabulary x ~2.5 float32 copies, so it needs
    # a large vocabulary (Gemma-3's 262144) and a few thousand tokens; SmolLM2 (vocab 49152) at
    # 1024 tokens saves only ~7 % of its growth.
    model: str = "gemma3-270m"
    seq_len: int = 2048
    batch_size: int = 1
    steps: int = 2
    backend: str = "auto"
    data: str | None = None
    learning_rate: float = 2e-5
    seed: int = 0
    json: str | None = None


def machine_summary() -> dict:
    """Date, CPU, core count, memory and library versions, for the table's caption."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def child_environment() -> tuple[dict[str, str], str | None]:
    """The environment of both training processes, and a note saying what it sets.

    PyTorch's OpenMP threads spin-wait on each other by default. On a CPU that other jobs also
    use, a spinning thread burns CPU time and stalls the step (measured here: 4-32 s instead of
    3.5 s for one SmolLM2 step; CPU time per step rose from 10.8 to 18.9-29.5 s). Load averages
    move too slowly to decide this when the runs start, so both runs always get
    ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep) unless the user chose a policy; both get the
    same setting, so the comparison stays fair.
    """
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" in env:
        return env, None
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env, (
        "both runs use OMP_WAIT_POLICY=PASSIVE, so that other work on this machine does not "
        "stall PyTorch's threads (set OMP_WAIT_POLICY to override)"
    )


def _spawn(config: RunConfig, workdir: Path, label: str, env: dict[str, str]) -> dict:
    path = workdir / f"{label}.json"
    path.write_text(json.dumps(asdict(config)))
    cmd = [sys.executable, "-m", "fused_ce_patch.demo.train", str(path)]
    result = subprocess.run(cmd, check=False, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"the {label} run failed (exit status {result.returncode})")
    return json.loads(Path(config.report).read_text())


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / |b|`` (0 when both are 0)."""
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else math.inf


def losses_match(fused: list[float], stock: list[float]) -> tuple[bool, float]:
    """Whether two loss curves are equal within float32 tolerance, and the largest rel. diff."""
    if len(fused) != len(stock) or not fused:
        return False, math.inf
    diffs = [rel_diff(a, b) for a, b in zip(fused, stock)]
    ok = diffs[0] <= FIRST_STEP_RTOL and all(d <= LATER_STEP_RTOL for d in diffs[1:])
    return ok, max(diffs)


def format_table(result: dict) -> str:
    """The demo's final table (Markdown, so it can be pasted into README.md as printed)."""
    fused, stock = result["fused"], result["stock"]
    setup, machine = result["setup"], result["machine"]
    lines = [
        f"{setup['title']} ({setup['model_type']}, vocab {setup['vocab_size']}), "
        f"{setup['steps']} steps x {setup['batch_size']} x {setup['seq_len']} tokens, "
        f"fused backend {fused['backend']!r}",
        f"{machine['date']}, {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['memory_gib']} GiB, torch {machine['torch']}, "
        f"transformers {machine['transformers']}",
        "",
        "| step | loss, fused | loss, stock | rel. diff |",
        "|---:|---:|---:|---:|",
    ]
    for i, (a, b) in enumerate(zip(fused["losses"], stock["losses"]), 1):
        lines.append(f"| {i} | {a:.6f} | {b:.6f} | {rel_diff(a, b):.1e} |")
    logits = setup["tokens_per_step"] * setup["vocab_size"] * 4
    peak_f, peak_s = fused["peak_rss_bytes"], stock["peak_rss_bytes"]
    extra_f = peak_f - fused["rss_before_bytes"]
    extra_s = peak_s - stock["rss_before_bytes"]
    cpu_f, cpu_s = fused["cpu_s_per_step"], stock["cpu_s_per_step"]
    lines += [
        "",
        "| | fused | stock | fused / stock |",
        "|---|---:|---:|---:|",
        f"| peak RSS while training (MiB) | {peak_f / MIB:,.0f} | {peak_s / MIB:,.0f} "
        f"| {peak_f / peak_s:.2f} |",
        f"| growth over RSS at start of training (MiB) | {extra_f / MIB:,.0f} "
        f"| {extra_s / MIB:,.0f} | {extra_f / extra_s:.2f} |",
        f"| CPU time per step, median (s) | {cpu_f:.1f} | {cpu_s:.1f} | {cpu_f / cpu_s:.2f} |",
        # Wall time follows the machine's load during each run, not the patch: shown, not
        # compared (the CPU time above is the comparable cost).
        f"| tokens/s, median step (wall clock: follows machine load) "
        f"| {fused['tokens_per_s']:.1f} | {stock['tokens_per_s']:.1f} | not compared |",
        f"| logits held by the model output | {_kinds(fused)} | {_kinds(stock)} | |",
        "",
        f"One float32 copy of this step's logits: {setup['tokens_per_step']} tokens x "
        f"{setup['vocab_size']} x 4 B = {logits / MIB:,.0f} MiB.",
        "Memory: peak resident set size (VmHWM, reset when training starts) of each run's own "
        "process; growth = peak minus RSS when training started (weights already loaded).",
        f"Load average (1 min) at start/end of training: fused {_load(fused)}, stock "
        f"{_load(stock)}; {machine['cores']} cores, so more than {machine['cores']} means "
        "other work competed for the CPU and slowed both runs (tokens/s less, CPU time more)"
        + (f" (OMP_WAIT_POLICY={machine['omp_wait_policy']})."
           if machine.get("omp_wait_policy") else "."),
    ]
    return "\n".join(lines)


def _load(report: dict) -> str:
    start, end = report.get("load_average", (math.nan, math.nan))
    return f"{start:.1f}/{end:.1f}"


def _kinds(report: dict) -> str:
    kinds = report["logits_types"]
    if kinds == ["Tensor"]:
        return "real tensor"
    return "none (sentinel)" if "Tensor" not in kinds else "/".join(kinds)


def run_demo(options: DemoOptions) -> int:
    """Run the demo as ``options`` say, print the table, and return the exit status
    (0 when the two loss curves agree, 1 otherwise)."""
    from transformers import AutoConfig, AutoTokenizer

    texts = data.read_texts(options.data)
    model_dir, title = models.resolve_model(options.model)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = options.data or data.default_source()
    n_rows = options.steps * options.batch_size
    repeat_note = []
    blocks = data.pack_blocks(
        tokenizer, texts, options.seq_len, n_rows,
        on_repeat=lambda have, need: repeat_note.append(
            f"note: the text has only {have:,} tokens and {need:,} are needed "
            f"({options.steps} steps x {options.batch_size} x {options.seq_len}); it is repeated "
            f"{-(-need // have)} times, so the model sees the same text more than once"
        ),
    )
    vocab = config.get_text_config().vocab_size
    tokens_per_step = options.batch_size * options.seq_len
    print(
        f"[fused_ce_patch] {title}: {config.model_type}, vocab {vocab}; text: {source} "
        f"({len(texts)} documents); {options.steps} steps x {options.batch_size} x "
        f"{options.seq_len} tokens; one float32 logits copy per step = "
        f"{tokens_per_step * vocab * 4 / MIB:,.0f} MiB",
        flush=True,
    )
    for note in repeat_note:
        print(f"[fused_ce_patch] {note}", flush=True)

    env, note = child_environment()
    if note:
        print(f"[fused_ce_patch] {note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fused_ce_demo_") as tmp:
        workdir = Path(tmp)
        torch.save(blocks, workdir / "blocks.pt")
        reports = {}
        for label, fused in (("fused", True), ("stock", False)):
            what = (
                f"fused loss (apply_fused_ce, backend={options.backend})"
                if fused
                else "stock model, same weights, seed and batches"
            )
            print(f"\n=== run {len(reports) + 1}/2: {what} ===", flush=True)
            run_config = RunConfig(
                model_dir=str(model_dir),
                blocks_file=str(workdir / "blocks.pt"),
                fused=fused,
                backend=options.backend,
                steps=options.steps,
                batch_size=options.batch_size,
                learning_rate=options.learning_rate,
                seed=options.seed,
                report=str(workdir / f"{label}.report.json"),
            )
            reports[label] = _spawn(run_config, workdir, label, env)

    result = {
        "setup": {
            "model": options.model,
            "title": title,
            "model_type": config.model_type,
            "vocab_size": vocab,
            "steps": options.steps,
            "batch_size": options.batch_size,
            "seq_len": options.seq_len,
            "tokens_per_step": tokens_per_step,
            "data": source,
            "learning_rate": options.learning_rate,
            "seed": options.seed,
        },
        "machine": {**machine_summary(), "omp_wait_policy": env.get("OMP_WAIT_POLICY")},
        **reports,
    }
    ok, worst = losses_match(reports["fused"]["losses"], reports["stock"]["losses"])
    result["losses_match"] = ok
    print("\n" + format_table(result) + "\n")
    if ok:
        print(
            f"Loss curves agree within float32 tolerance (largest relative difference "
            f"{worst:.1e}; allowed {FIRST_STEP_RTOL:g} at step 1, {LATER_STEP_RTOL:g} after)."
        )
    else:
        print(f"LOSS CURVES DIFFER: largest relative difference {worst:.1e}.")
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"Results written to {options.json}")
    return 0 if ok else 1
