"""Real English text for the demo, packed into fixed-length blocks of token ids.

By default the text is the licence collection every Debian/Ubuntu machine carries under
``/usr/share/common-licenses`` (about 260 KB of English prose: GPL, Apache, MPL, ...). Where
that folder does not exist (other systems), the default is the documentation of a fixed set of
Python standard-library modules, which every Python installation carries. A user's file
replaces either with ``--data`` (the demo and every example take it): ``.txt`` (one document)
or ``.jsonl`` (one JSON object per line with a ``"text"`` field).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

DEFAULT_TEXT_DIR = Path("/usr/share/common-licenses")
# The fallback corpus: English prose present wherever Python is (unless run with -OO).
FALLBACK_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib",
                    "re", "shutil", "subprocess", "textwrap", "difflib", "logging")


class DataError(ValueError):
    """Training text that cannot be used: missing, empty, or in an unsupported format."""


def read_texts(path: str | Path | None = None) -> list[str]:
    """Read the documents of ``path`` (a ``.txt``/``.jsonl`` file or a directory of text files).

    Args:
        path: None for :data:`DEFAULT_TEXT_DIR`, or :func:`standard_library_texts` where that
            folder does not exist. A directory contributes each regular file in
            it (sorted by name, symbolic links to files already read skipped), each as one
            document.

    Returns:
        Non-empty documents in a fixed order.

    Raises:
        DataError: the path does not exist, a ``.jsonl`` line without a string ``"text"``
            field, an unsupported file type, or no text at all.
    """
    if path is None and not DEFAULT_TEXT_DIR.is_dir():
        return standard_library_texts()
    path = Path(path) if path is not None else DEFAULT_TEXT_DIR
    if not path.exists():
        raise DataError(f"--data {str(path)!r} does not exist")
    if path.is_dir():
        texts, seen = [], set()
        for item in sorted(path.iterdir()):
            real = item.resolve()
            if not real.is_file() or real in seen:
                continue
            seen.add(real)
            texts.append(real.read_text(encoding="utf-8", errors="replace"))
    elif path.suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f"{path}:{number}: expected a JSON object with a string 'text'")
                texts.append(record["text"])
    elif path.suffix in (".txt", ".text", ".md", ""):
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    else:
        raise DataError(f"--data {str(path)!r}: expected a .txt or .jsonl file (or a directory)")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"--data {str(path)!r} holds no text")
    return texts


def default_source() -> str:
    """Where :func:`read_texts` takes its default text from on this machine, for headers."""
    if DEFAULT_TEXT_DIR.is_dir():
        return str(DEFAULT_TEXT_DIR)
    return f"Python {sys.version_info.major}.{sys.version_info.minor} standard-library " \
           f"docstrings ({', '.join(FALLBACK_MODULES)})"


def standard_library_texts() -> list[str]:
    """The documentation of :data:`FALLBACK_MODULES`: one document per module.

    Each document is the module's docstring followed by those of its public classes and
    functions, in name order, so the text is the same for a given Python version.

    Raises:
        DataError: the docstrings were stripped (``python -OO``).
    """
    import importlib
    import inspect

    texts = []
    for name in FALLBACK_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            parts.append(inspect.getdoc(obj) or "")
        texts.append("\n\n".join(p for p in parts if p.strip()))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(
            f"{DEFAULT_TEXT_DIR} does not exist and Python's docstrings are stripped (-OO): "
            "pass a text file with --data"
        )
    return texts


def pack_blocks(
    tokenizer, texts: list[str], seq_len: int, n_blocks: int, *, on_repeat=None
) -> torch.Tensor:
    """Tokenise ``texts`` and cut the stream into ``n_blocks`` rows of ``seq_len`` tokens.

    Documents are joined with the tokenizer's end-of-sequence token, the usual way to pack
    pre-training text. When the text is shorter than ``n_blocks * seq_len`` tokens the stream
    is repeated, so any ``--steps`` works on the small default corpus.

    Args:
        tokenizer: a transformers tokenizer.
        texts: documents, in order.
        seq_len: tokens per row, ``>= 2``.
        n_blocks: rows wanted, ``>= 1``.
        on_repeat: called as ``on_repeat(available, needed)`` (token counts) when the text is
            too short and will be repeated, so the caller can say so.

    Returns:
        ``[n_blocks, seq_len]`` int64 token ids.
    """
    if seq_len < 2 or n_blocks < 1:
        raise ValueError(f"need seq_len >= 2 and n_blocks >= 1, got {seq_len}, {n_blocks}")
    sep = tokenizer.eos_token_id
    stream: list[int] = []
    need = seq_len * n_blocks
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if sep is not None:
            stream.append(sep)
        if len(stream) >= need:
            break
    if not stream:
        raise ValueError("the text tokenises to nothing")
    repeats = -(-need // len(stream))
    if repeats > 1 and on_repeat is not None:
        on_repeat(len(stream), need)
    ids = torch.tensor((stream * repeats)[:need], dtype=torch.long)
    return ids.view(n_blocks, seq_len)


def corpus_tokens(tokenizer, texts: list[str]) -> int:
    """Number of tokens in ``texts`` (without separators), for the demo's header line."""
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
