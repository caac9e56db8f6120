"""Parity sweep: every causal-LM type in transformers' registry, patched vs stock, on CPU.

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (plus :data:`MULTIMODAL`) it
derives the class's spec and runs :func:`~fused_ce_patch.hf.proof.prove` — the same check
``apply_fused_ce`` runs on the user's machine before patching a class (without its caches):
a tiny random model (the config class's defaults shrunk by :func:`tiny_config`: 2 layers,
hidden 64, 4 heads, 4 experts, vocab 1000, no dropout; :data:`OVERRIDES` per type only where
needed), stock against a patched deep copy, loss, every parameter gradient and the MoE router
aux loss on three batches (:func:`_batches`: right padding, ``num_items_in_batch``,
``shift_labels``), float64 where the model runs in it.

Usage::

    python -m fused_ce_patch.hf.sweep [--jobs 2] [--types llama,qwen3] [--json out.json]
                                      [--record docs/support.json] [--write] [--check]
                                      [--docs docs/support.md] [--readme README.md]

The record (``docs/support.json``, one row per type and transformers release) is
documentation: the full support table in ``docs/support.md`` (``--docs``) and the one-line
summary on README's front page (``--readme``) are generated from it, and CI compares a
fresh sweep with it (``--check``: exit status 1 when a type recorded as passing on this release
— or, for a release not recorded, on the newest recorded one — fails now). Nothing reads it at
patch time. ``--write`` stores this run's rows for the installed release in it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .tiny import (  # noqa: F401 - re-exported: the sweep's tiny models are tiny.py's
    MULTIMODAL,
    OVERRIDES,
    SHRINK,
    VOCAB,
    _batches,
    registry,
    tiny_config,
)

TIMEOUT_S = 300


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"over {TIMEOUT_S}s")


def check_type(model_type: str) -> dict:
    """Run the parity check for one model type; returns a result row (never raises)."""
    import torch

    import logging

    torch.set_num_threads(1)
    # the sweep's own patches need no INFO record; the level is put back afterwards, so a
    # check run inside a user's (or a test's) process leaves its logging as it was
    patch_logger = logging.getLogger("fused_ce_patch.hf.patch")
    level = patch_logger.level
    patch_logger.setLevel(logging.ERROR)
    class_name = registry()[model_type]
    row = {"type": model_type, "class": class_name}
    start = time.perf_counter()
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(TIMEOUT_S)
    try:
        row.update(_check(model_type, class_name, torch))
    except _Timeout as exc:
        row.update(status="error", reason=f"timed out ({exc})")
    except Exception as exc:  # noqa: BLE001 - every failure is a refusal with its reason
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{os.path.basename(last.filename)}:{last.lineno}"
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:200]} ({where})")
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
        patch_logger.setLevel(level)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _check(model_type, class_name, torch):
    import transformers

    from ..errors import NoLossToFuseError, UnsupportedModelError
    from .patch import spec_for_class
    from .proof import prove

    cls = getattr(transformers, class_name)
    try:
        spec = spec_for_class(cls, model_type, check_verified=False)
    except NoLossToFuseError as exc:
        reason = str(exc).split("; supported model types")[0]
        return {"status": "noloss", "reason": reason.split(": ", 1)[-1]}
    except UnsupportedModelError as exc:
        reason = str(exc).split("; supported model types")[0]
        return {"status": "unsupported", "reason": reason.split(": ", 1)[-1]}
    out = {"transform": spec.transform_name, "transform_expr": list(spec.transform),
           "moe_aux": spec.moe_aux, "source_hash": spec.source_hash,
           "defining_class": spec.class_name}
    row = prove(cls, spec, model_type)  # the very check apply_fused_ce runs (no caches here)
    if row["status"] == "unbuildable":
        # Our tiny builder's model did not build or run: prove on the class's default config
        # as a user's model would be (hf/live_config.py: shrunk with its structure kept).
        full = _default_config(cls, model_type)
        if full is not None:
            again = prove(cls, spec, model_type, config=full)
            if again["status"] != "unbuildable":
                again["config"] = again.get("config", "").replace(
                    "your config", "the class's default config as a user's")
                again["tiny_reason"] = row.get("reason")
                row = again
            else:  # both reasons: the tiny builder's and the default config's own
                mine = [part.replace("(your config", "(the default config")
                        for part in again.get("reason", "").split("; ")
                        if "(your config" in part]
                row["reason"] = "; ".join([row.get("reason", ""), *mine])
    row.pop("seconds", None)  # check_type times the whole row
    out.update(row)
    return out


def _default_config(cls, model_type):
    """The full-size default config of ``cls`` (the text config under a composite type)."""
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
        if not isinstance(config, cls.config_class) and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        return config
    except Exception:  # noqa: BLE001 - no default config: the tiny builder's reason stands
        return None


def run(types=None, jobs=2, progress=True) -> list[dict]:
    """Check ``types`` (default: :func:`registry`) in ``jobs`` processes; rows sorted."""
    names = registry()
    types = sorted(types or names)
    rows = []
    if jobs <= 1:
        it = map(check_type, types)
        for row in it:
            rows.append(row)
            if progress:
                _print_row(row)
    else:
        import multiprocessing
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        ctx = multiprocessing.get_context("spawn")
        todo, workers = list(types), jobs
        while todo:
            crashed = []
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = {pool.submit(check_type, t): t for t in todo}
                for fut in as_completed(futures):
                    try:
                        row = fut.result()
                    except BrokenProcessPool:  # a worker died (segfault, OOM kill)
                        crashed.append(futures[fut])
                        continue
                    rows.append(row)
                    if progress:
                        _print_row(row)
            if not crashed:
                break
            if workers == 1:
                # One worker runs the tasks in order: the first unfinished one killed it.
                culprit = min(crashed, key=todo.index)
                crashed.remove(culprit)
                row = {"type": culprit, "class": names[culprit],
                       "status": "error", "reason": "the sweep worker process died"}
                rows.append(row)
                if progress:
                    _print_row(row)
            workers = 1
            todo = sorted(crashed, key=todo.index)
    return sorted(rows, key=lambda r: r["type"])


def _print_row(row):
    extra = row.get("reason", "")
    print(f"{row['status']:12s} {row['type']:28s} {row['class']:40s} "
          f"{row.get('transform', ''):10s} {extra}", flush=True)


# -- the record (docs/support.json), docs/support.md's table and README's summary -------------

_KEEP = ("class", "defining_class", "status", "reason", "transform", "transform_expr", "moe_aux",
         "source_hash", "dtype")


def write_record(rows, path=None) -> None:
    """Store ``rows`` for the installed transformers version in the record at ``path``."""
    import transformers

    from .verified import RECORD_PATH

    path = Path(path or RECORD_PATH)
    data = json.loads(path.read_text()) if path.exists() else {"types": {}}
    version = transformers.__version__
    for row in rows:
        entry = {k: row[k] for k in _KEEP if k in row}
        if row.get("config") not in (None, "the class's default config"):
            entry["config"] = row["config"]  # proven on the default config shrunk, not tiny.py's
        if "defining_class" in entry:  # the class whose forward source was rewritten
            entry["class"], entry["registry_class"] = entry.pop("defining_class"), row["class"]
        data["types"].setdefault(row["type"], {})[version] = entry
    data["types"] = dict(sorted(data["types"].items()))
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def _version_key(v: str):
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def check_against_record(rows, data: dict, version: str) -> tuple[str, list[str], list[str]]:
    """Compare a sweep's ``rows`` with the record.

    Raises:
        ValueError: the record is empty.

    Returns:
        ``(baseline, lost, gained)``: the recorded version compared against (``version`` when
        recorded, else the newest recorded one), the types recorded as passing there that did
        not pass now (with their reasons), and the types passing now but not recorded so.
    """
    versions = {v for r in data["types"].values() for v in r}
    if not versions:
        raise ValueError("the record holds no sweep results")
    if version in versions:
        baseline = version
    else:
        older = [v for v in versions if _version_key(v) <= _version_key(version)]
        baseline = max(older or versions, key=_version_key)
    now = {r["type"]: r for r in rows}
    lost, gained = [], []
    for model_type, row in sorted(now.items()):
        recorded = data["types"].get(model_type, {}).get(baseline, {})
        if recorded.get("status") == "pass" and row["status"] != "pass":
            lost.append(f"{model_type}: {row['status']}: {row.get('reason', '')}")
        elif row["status"] == "pass" and recorded.get("status") != "pass":
            gained.append(model_type)
    return baseline, lost, gained


BEGIN = ("<!-- support-table:begin (generated by python -m fused_ce_patch.hf.sweep "
         "--docs docs/support.md) -->")
END = "<!-- support-table:end -->"
SUMMARY_BEGIN = ("<!-- support-summary:begin (generated by python -m fused_ce_patch.hf.sweep "
                 "--readme README.md) -->")
SUMMARY_END = "<!-- support-summary:end -->"


def _versions(data: dict) -> list[str]:
    return sorted({v for rows in data["types"].values() for v in rows}, key=_version_key)


def support_summary(data: dict) -> str:
    """One sentence: how many types pass in all, and how many of how many per release."""
    passed = [t for t, rows in data["types"].items()
              if any(r.get("status") == "pass" for r in rows.values())]
    counts = "; ".join(
        f"{v}: {sum(r.get(v, {}).get('status') == 'pass' for r in data['types'].values())} of "
        f"{sum(v in r for r in data['types'].values())}" for v in _versions(data)
    )
    return (f"Recorded by the parity sweep ({len(passed)} types passing in all) — transformers "
            f"{counts}.")


def support_table(data: dict) -> str:
    """Markdown: one row per model type, with the versions each passed / was refused on."""
    versions = _versions(data)
    lines = [
        f"{support_summary(data)} The sweep runs the same proof that `apply_fused_ce` runs on "
        "your machine before it patches a class (stock vs patched, loss and every gradient on a "
        "tiny model); a class is patched on any transformers release where its installed code "
        "passes it, and refused with the reason where it does not.",
        "",
        "| type | class | transform | MoE aux | " + " | ".join(versions) + " |",
        "|---|---|---|---|" + "---|" * len(versions),
    ]
    refused = []
    for model_type, rows in data["types"].items():
        any_row = next(iter(rows.values()))
        cells = []
        for v in versions:
            r = rows.get(v)
            cells.append("—" if r is None else
                         ("pass" if r.get("status") == "pass" else "refused"))
            if r is not None and r.get("status") != "pass":
                refused.append((model_type, v, r.get("reason", r.get("status")),
                                r.get("status")))
        if not any(r.get("status") == "pass" for r in rows.values()):
            continue
        best = next(r for r in rows.values() if r.get("status") == "pass")
        lines.append(
            f"| {model_type} | {best.get('registry_class', any_row.get('class'))} | "
            f"{best.get('transform', '')} | {'yes' if best.get('moe_aux') else ''} | "
            + " | ".join(cells) + " |"
        )
    for status, title in REFUSAL_KINDS:
        rows = [r for r in refused if _kind(r[3]) == status]
        if not rows:
            continue
        lines += ["", f"<details><summary>{title} ({_per_release(rows, versions)})</summary>",
                  "", "| type | transformers | reason |", "|---|---|---|"]
        for model_type, v, reason, _ in rows:
            reason = str(reason).replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {model_type} | {v} | {reason} |")
        lines += ["", "</details>"]
    return "\n".join(lines)


#: The refused lists of docs/support.md, by the proof's status.
REFUSAL_KINDS = (
    ("unsupported", "Refused by the patch: it cannot express this forward"),
    ("different", "Refused: the patched forward differs from stock, or raised"),
    ("unbuildable", "Not proven: no stock model built from the class's default config trains "
                    "here (a model from your own config is proven on it)"),
    ("noloss", "Nothing to fuse: the forward takes no labels and computes no loss"),
)


def _kind(status) -> str:
    return status if status in ("unsupported", "unbuildable", "noloss") else "different"


def _per_release(rows, versions) -> str:
    return ", ".join(f"{v}: {n}" for v in versions
                     if (n := sum(r[1] == v for r in rows)))


def _write_between(path, begin: str, end: str, body: str) -> bool:
    """Replace the text between the markers ``begin`` and ``end`` in ``path`` with ``body``.

    Returns:
        True when the file changed.

    Raises:
        ValueError: ``path`` lacks one of the markers.
    """
    text = open(path, encoding="utf-8").read()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no generated-block markers ({begin!r} ... {end!r})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{body}\n{end}{tail}"
    if new != text:
        open(path, "w", encoding="utf-8").write(new)
    return new != text


def write_docs(page, data=None) -> bool:
    """Regenerate the full support table in ``page`` (docs/support.md); True when it changed."""
    from .verified import load

    return _write_between(page, BEGIN, END, support_table(data or load()))


def write_readme(readme, data=None) -> bool:
    """Regenerate README's one-line support summary; True when the file changed."""
    from .verified import load

    return _write_between(readme, SUMMARY_BEGIN, SUMMARY_END, support_summary(data or load()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", help="write the result rows here")
    parser.add_argument("--record", help="the record file (default: docs/support.json of the "
                        "source checkout)")
    parser.add_argument("--write", action="store_true",
                        help="store this run's rows for the installed release in the record")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a type the record lists as passing fails now")
    parser.add_argument("--docs", help="regenerate the full support table in this page "
                        "(docs/support.md)")
    parser.add_argument("--readme", help="regenerate the support summary in this README")
    args = parser.parse_args(argv)
    rows = []
    status = 0
    if args.types != "":
        types = args.types.split(",") if args.types else None
        start = time.perf_counter()
        rows = run(types, jobs=args.jobs)
        passed = [r for r in rows if r["status"] == "pass"]
        print(f"\n{len(passed)} of {len(rows)} types pass the proof "
              f"({time.perf_counter() - start:.0f} s); the others:")
        for r in rows:
            if r["status"] != "pass":
                print(f"  {r['type']}: {r['status']}: {r.get('reason', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.check:
        import transformers

        from .verified import RECORD_PATH, load

        data = load(args.record)
        if not data["types"]:
            print(f"--check: no record at {args.record or RECORD_PATH}", file=sys.stderr)
            return 2
        baseline, lost, gained = check_against_record(rows, data, transformers.__version__)
        print(f"\nagainst the record for transformers {baseline}: {len(lost)} lost, "
              f"{len(gained)} newly passing {gained if gained else ''}")
        for line in lost:
            print(f"  LOST {line}")
        status = 1 if lost else 0
    if args.write:
        write_record(rows, args.record)
    if args.docs or args.readme:
        from .verified import load

        data = load(args.record)
        if args.docs:
            write_docs(args.docs, data)
        if args.readme:
            write_readme(args.readme, data)
    return status


if __name__ == "__main__":
    sys.exit(main())
