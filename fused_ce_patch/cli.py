"""Command line: ``fused-ce-patch {demo,doctor,model-path}`` (also ``python -m fused_ce_patch``).

``demo`` fine-tunes a real model with the fused loss and then stock, and prints a side-by-side
table of loss per step, peak memory and CPU time per step. ``doctor`` reports versions, devices, the
backend ``"auto"`` picks, and a numeric check of every backend that can run here.
``model-path`` prints the local directory of a packaged model's real weights: that line alone
on stdout (for ``$(fused-ce-patch model-path smollm2)``); the first use's notices, progress and
whatever the libraries print meanwhile go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


@contextlib.contextmanager
def stdout_to_stderr():
    """Send whatever is written to stdout meanwhile to stderr: Python's prints and, through file
    descriptor 1, C libraries and child processes (a library imported on the way may print a
    notice to stdout, which must not end up in ``$(fused-ce-patch model-path ...)``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def program_name(argv0: str | None = None) -> str:
    """How the user started us: ``fused-ce-patch`` (the script) or ``python -m fused_ce_patch``."""
    name = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    if not name or name in ("__main__.py", "-m", "-c") or name.endswith(".py"):
        return "python -m fused_ce_patch"
    return name


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    from . import __version__
    from .demo.compare import DemoOptions

    defaults = DemoOptions()
    parser = argparse.ArgumentParser(
        prog=prog or program_name(),
        description="Fused linear cross-entropy for Hugging Face causal LMs: demo and checks.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{demo,doctor,model-path}"
    )

    demo = sub.add_parser(
        "demo",
        help="fine-tune a real model fused, then stock, and compare loss, memory and CPU time",
        description=(
            "Fine-tune a real model with transformers' Trainer twice from the same start, each "
            "run in its own process: first with apply_fused_ce, then stock. Prints the loss of "
            "every step side by side, the peak resident memory and CPU time per step of each "
            "run, and (not compared: it follows machine load) tokens/s."
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
    demo.add_argument("--backend", default=defaults.backend, choices=_backend_choices(),
                      metavar="BACKEND",
                      help="backend of the fused loss: auto, torch, triton, ascend, reference; "
                      "the demo trains on the CPU, so triton and ascend are refused unless "
                      "they can run there (default: %(default)s)")
    demo.add_argument("--data", default=defaults.data,
                      help="training text: a .txt file, a .jsonl file with a \"text\" field per "
                      "line, or a directory of text files (default: /usr/share/common-licenses, "
                      "or where that is absent the docstrings of a few Python standard-library "
                      "modules)")
    demo.add_argument("--lr", dest="learning_rate", type=float, default=defaults.learning_rate,
                      help="AdamW learning rate, constant (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=defaults.seed,
                      help="seed of both runs (default: %(default)s)")
    demo.add_argument("--json", default=None, metavar="PATH",
                      help="also write every number of the comparison to PATH as JSON")
    demo.set_defaults(demo_parser=demo)

    model_path = sub.add_parser(
        "model-path",
        help="print the local directory of a packaged model (dequantised and cached on first use)",
        description=(
            "Print the local Hugging Face directory holding a packaged model's real weights, "
            "for from_pretrained(...) with no network. Same as "
            "fused_ce_patch.demo.local_model_path(NAME)."
        ),
    )
    model_path.add_argument("name", nargs="?", default="smollm2",
                            help="smollm2 or gemma3-270m (default: %(default)s)")

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


def _backend_choices() -> tuple[str, ...]:
    from .backends import backend_names

    return backend_names()


def _demo_backend_problem(name: str) -> str | None:
    """Why ``--backend name`` cannot run the demo (float32 on the CPU), or None if it can."""
    import torch

    from .backends.registry import resolve
    from .errors import BackendUnavailableError

    try:
        resolve(name, torch.device("cpu"), torch.float32)
    except (BackendUnavailableError, ValueError) as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .demo.doctor import run_doctor

        return run_doctor()

    from .demo.data import DataError
    from .demo.models import ModelNotFoundError

    if args.command == "model-path":
        from .demo.models import local_model_path

        try:
            with stdout_to_stderr():  # the first use takes 20-90 s: say so, on stderr
                path = local_model_path(args.name)
        except ModelNotFoundError as exc:
            print(f"{parser.prog} model-path: error: {exc}", file=sys.stderr)
            return 2
        print(path)
        return 0

    from .demo.compare import DemoOptions, run_demo

    problem = _demo_backend_problem(args.backend)
    if problem:
        args.demo_parser.error(f"argument --backend: {problem}")
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
        print(f"{parser.prog} demo: error: {exc}", file=sys.stderr)
        return 2
