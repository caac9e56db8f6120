"""Command line: ``python -m fused_ce_patch {demo,doctor}`` (also installed as ``fused-ce-patch``).

``demo`` fine-tunes a real model with the fused loss and then stock, and prints a side-by-side
table of loss per step, peak memory and tokens/s. ``doctor`` reports versions, devices, the
backend ``"auto"`` picks, and a numeric check of every backend that can run here.
"""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of both sub-commands."""
    from .demo.compare import DemoOptions

    defaults = DemoOptions()
    parser = argparse.ArgumentParser(
        prog="python -m fused_ce_patch",
        description="Fused linear cross-entropy for Hugging Face causal LMs: demo and checks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,doctor}")

    demo = sub.add_parser(
        "demo",
        help="fine-tune a real model fused, then stock, and compare loss, memory and speed",
        description=(
            "Fine-tune a real model with transformers' Trainer twice from the same start, each "
            "run in its own process: first with apply_fused_ce, then stock. Prints the loss of "
            "every step side by side, the peak resident memory of each run, and tokens/s."
        ),
    )
    demo.add_argument(
        "--model",
        default=defaults.model,
        help="smollm2 (SmolLM2-135M-Instruct, vocab 49152), gemma3-270m (Gemma-3-270M, vocab "
        "262144), a Hugging Face model directory, or a .gguf file (default: %(default)s)",
    )
    demo.add_argument("--seq-len", type=_positive, default=defaults.seq_len,
                      help="tokens per row (default: %(default)s)")
    demo.add_argument("--batch-size", type=_positive, default=defaults.batch_size,
                      help="rows per optimizer step (default: %(default)s)")
    demo.add_argument("--steps", type=_positive, default=defaults.steps,
                      help="optimizer steps per run (default: %(default)s)")
    demo.add_argument("--backend", default=defaults.backend,
                      help="backend of the fused loss: auto, torch, triton, ascend, reference "
                      "(default: %(default)s)")
    demo.add_argument("--data", default=defaults.data,
                      help="training text: a .txt file, a .jsonl file with a \"text\" field per "
                      "line, or a directory of text files (default: /usr/share/common-licenses)")
    demo.add_argument("--lr", dest="learning_rate", type=float, default=defaults.learning_rate,
                      help="AdamW learning rate, constant (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=defaults.seed,
                      help="seed of both runs (default: %(default)s)")
    demo.add_argument("--json", default=None, metavar="PATH",
                      help="also write every number of the comparison to PATH as JSON")

    sub.add_parser(
        "doctor",
        help="versions, devices, the backend 'auto' picks, and a numeric check of each backend",
        description=(
            "Report versions of torch/triton/transformers/accelerate/peft, the devices seen, "
            "which backend 'auto' picks on each and why, and check every backend that can run "
            "against a float64 reference. Exit status 1 if any check fails."
        ),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .demo.doctor import run_doctor

        return run_doctor()

    from .backends import backend_names
    from .demo.compare import DemoOptions, run_demo
    from .demo.data import DataError
    from .demo.models import ModelNotFoundError

    if args.backend not in backend_names():
        print(f"--backend {args.backend!r}: choose from {', '.join(backend_names())}",
              file=sys.stderr)
        return 2
    options = DemoOptions(
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        backend=args.backend,
        data=args.data,
        learning_rate=args.learning_rate,
        seed=args.seed,
        json=args.json,
    )
    try:
        return run_demo(options)
    except (ModelNotFoundError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
