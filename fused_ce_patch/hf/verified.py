"""The parity sweep's record (``docs/support.json``) and the ``FUSED_CE_ALLOW_UNVERIFIED`` switch.

The record is documentation, read by nothing at patch time: every class is proven on the
user's machine before it is patched (:mod:`.proof`). It holds one row per model type and
transformers release that the sweep (:mod:`.sweep`) ran on — status, reason, derived transform —
from which docs/support.md's table and README's summary are generated and against which CI
checks a fresh sweep.

``FUSED_CE_ALLOW_UNVERIFIED=1`` patches a derivable class whose proof could not run (no tiny
model could be built); a proven difference is refused regardless.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The record: docs/support.json of a source checkout, else the copy a wheel carries beside
#: this module (setup.py puts it there).
_CHECKOUT_RECORD = Path(__file__).resolve().parents[2] / "docs" / "support.json"
RECORD_PATH = (_CHECKOUT_RECORD if _CHECKOUT_RECORD.exists()
               else Path(__file__).with_name("support.json"))
ALLOW_ENV = "FUSED_CE_ALLOW_UNVERIFIED"


def load(path: str | os.PathLike | None = None) -> dict:
    """The record as ``{"types": {model_type: {version: row}}}`` (empty when absent)."""
    path = Path(path) if path else RECORD_PATH
    if not path.exists():
        return {"types": {}}
    return json.loads(path.read_text())


def verified_types() -> list[str]:
    """Model types the record lists as passing on the installed transformers (documentation,
    from a checkout or an installed wheel). Not a gate: see :mod:`.proof`."""
    import transformers

    version = transformers.__version__
    return sorted(t for t, rows in load()["types"].items()
                  if rows.get(version, {}).get("status") == "pass")


def allow_unverified() -> bool:
    """``$FUSED_CE_ALLOW_UNVERIFIED`` is set to something other than ``"" / 0 / false / no /
    off``."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
