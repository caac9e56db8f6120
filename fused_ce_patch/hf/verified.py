"""The parity sweep's committed results (``verified.json``) and the support decision.

Policy: a class is patched only when the sweep (:mod:`.sweep`) has proven the rewrite of the
very forward source installed now: the proof is stored under the class name and a hash of its
``forward`` source, with the transformers versions it passed on. The rewrite leaves the decoder
untouched, so the same forward source on another transformers version gets the same rewrite;
a changed source (a transformers upgrade that edits the forward) is refused until the sweep has
run on it. ``FUSED_CE_ALLOW_UNVERIFIED=1`` patches a derivable but unproven class anyway, with a
warning (for trying a new transformers release before the table is updated).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

VERIFIED_PATH = Path(__file__).with_name("verified.json")
ALLOW_ENV = "FUSED_CE_ALLOW_UNVERIFIED"


@functools.lru_cache(maxsize=None)
def load() -> dict:
    """``verified.json`` as a dict (``{"types": {model_type: {version: row}}}``)."""
    if not VERIFIED_PATH.exists():
        return {"types": {}}
    return json.loads(VERIFIED_PATH.read_text())


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def proofs_for(class_name: str, source_hash: str) -> list[str]:
    """transformers versions on which the sweep passed ``class_name`` with this source."""
    versions = set()
    for rows in load()["types"].values():
        for version, row in rows.items():
            if (row.get("status") == "pass" and row.get("class") == class_name
                    and row.get("source_hash") == source_hash):
                versions.add(version)
    return sorted(versions)


def refusal_for(class_name: str) -> str | None:
    """The sweep's failure reason for ``class_name`` on the installed version, if recorded."""
    version = _transformers_version()
    for rows in load()["types"].values():
        row = rows.get(version)
        if row and row.get("class") == class_name and row.get("status") != "pass":
            return row.get("reason") or row.get("status")
    return None


def verified_types() -> list[str]:
    """Model types verified on the installed transformers version (sorted)."""
    version = _transformers_version()
    return sorted(t for t, rows in load()["types"].items()
                  if rows.get(version, {}).get("status") == "pass")


def allow_unverified() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
