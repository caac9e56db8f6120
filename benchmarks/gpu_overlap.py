"""Schedule variants of backend "triton"'s chunked path at its default budget (issue 14).

Question: which of the variants of ``ChunkedTuning`` (``fused_ce_patch/backends/triton/
chunked_path.py``; selected here through its internal environment variable) bring the
chunked path closer to the three-matmul floor, at what memory, with the same results? And
where does the default schedule's time go at llama3-8b and gemma3-270m?

Variants (``--variants``, ``name=<tuning>`` items separated by ``;``; the first is the one the
others are compared with, and the stage timing below always runs the default schedule):
    base           the default schedule
    overlap        next chunk's logits on a side stream, two buffers of half the rows each
    overlap-2x     the same with full-size chunks (two buffers: ~one more chunk of logits)
    dh-first       dH's matmul before dW's addmm
    rows-2x        chunks of twice the rows (fewer dW read-modify-writes; twice the memory)
    persist-1x16w  row kernel as a persistent grid, 1 program of 16 warps per SM: the rows in
                   flight (132 x 256 KiB at llama3) may fit the 50 MB L2, so the gradient
                   pass could re-read them from L2 (one program per row keeps all rows of a
                   chunk in flight at once, far beyond L2)
    persist-0.5x16w  the same with one program per two SMs (gemma3's 512 KiB rows)
    persist-2x8w   row kernel as a persistent grid, 2 programs of 8 warps per SM
    bv8192-16w     row kernel with BLOCK_V 8192 and 16 warps
    overlap+persist  overlap with persist-1x16w's row kernel
plus ``cublas-3gemm`` from ``gpu_bench.py`` (the floor: three matmuls on the counted rows).

Method (``gpu_bench.measure``): random bf16 inputs, 10% of labels ignored, mean reduction;
one fwd+bwd first for the errors, ``--warmup`` runs, one run for memory, then the median of
``--iters`` fwd+bwd timed with CUDA events. "extra": peak allocated during one fwd+bwd minus
what was allocated before it, minus the bf16 dH and dW. Errors: ``||x - base|| / ||base||``
for loss, dH, dW against the first variant's results on the same inputs (0: bitwise equal;
the base row itself checks run-to-run determinism). Stages (``--stages``, default schedule):
a copy of the eager pass with CUDA events between its steps (logits matmul, row kernel, dW
addmm, dH matmul, dH copy, target column), summed over chunks, median of ``--stage-iters``
fwd+bwd; its results are checked against the base variant's.

Writes ``gpu_overlap.json`` under ``--out`` (default ``$OUT`` or ``benchmarks/results``) and
prints tables. ``--max-s`` stops measuring new rows once that much wall time has passed.
``--tiny``: CPU dry run under the Triton interpreter, small shapes and 16-row chunks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_bench  # noqa: E402  (inputs, measurement, cleanup, environment)
from timing import Laps  # noqa: E402  (the timer of every benchmark)

VARIANTS = ("base=;overlap=overlap;overlap-2x=overlap,rows=2;dh-first=dh_first;rows-2x=rows=2;"
            "persist-1x16w=programs=1,warps=16;persist-0.5x16w=programs=0.5,warps=16;"
            "persist-2x8w=programs=2;bv8192-16w=block_v=8192,warps=16;"
            "overlap+persist=overlap,programs=1,warps=16")  # fmt: skip
#: Most informative first; the 32K-row llama3 shape is the slowest, last.
SHAPES = ("llama3-8b,gemma3-270m,gemma2-2b,qwen2.5-7b,llama2-7b,llama3-8b-long")
STAGE_SHAPES = "llama3-8b,gemma3-270m"
MiB = 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--stages", default=STAGE_SHAPES, help="shapes with per-stage timing")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stage-iters", type=int, default=3)
    p.add_argument("--max-s", type=float, default=140.0, help="wall-time guard")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tiny", action="store_true", help="CPU dry run under the interpreter")
    args = p.parse_args()
    t_start = time.time()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        args.iters, args.warmup, args.stage_iters = 1, 0, 1
    import torch

    from fused_ce_patch.backends.triton import chunked_path

    dev = "cpu" if args.tiny else "cuda"
    if args.tiny:
        shapes = dict(gpu_bench.TINY)
        stage_shapes = list(shapes)
    else:
        shapes = {k: gpu_bench.SHAPES[k] for k in _names(args.shapes)}
        stage_shapes = _names(args.stages)
    variants = [tuple(item.split("=", 1)) for item in args.variants.split(";") if item.strip()]
    for name, text in variants:  # fail before any device work on a malformed variant
        chunked_path.parse_tuning(text)
    env = gpu_bench.environment(torch, dev)
    env["variants"] = dict(variants)
    print(json.dumps(env), flush=True)
    out = {"env": env, "rows": [], "stages": [], "skipped": []}

    for shape, (n, h, v, softcap) in shapes.items():
        print(f"\n== {shape}: N={n} H={h} V={v} softcap={softcap}", flush=True)
        data = gpu_bench.make_inputs(torch, n, h, v, dev)
        # tiny: 16-row chunks so that every variant runs several chunks
        budget = 16 * v * 2 if args.tiny else None
        ref = None
        for name, text in [*variants, ("cublas-3gemm", None)]:
            if time.time() - t_start > args.max_s:
                out["skipped"].append(f"{shape}/{name}")
                continue
            t0 = time.time()
            try:
                if text is None:
                    fn = gpu_bench.build(torch, "cublas-3gemm", softcap, dev)
                    row = gpu_bench.measure(torch, fn, data, None, args, dev, time_only=True)
                else:
                    if ref is None:
                        ref = baseline(torch, data, softcap, budget, text, chunked_path)
                    row = measure_variant(torch, data, ref, softcap, budget, text, args, dev,
                                          chunked_path)  # fmt: skip
            except Exception as exc:  # one failing variant must not end the run
                traceback.print_exc()
                row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            finally:
                os.environ.pop(chunked_path.TUNING_ENV, None)
            row.update(shape=shape, variant=name, tuning=text, N=n, H=h, V=v, softcap=softcap,
                       wall_s=round(time.time() - t0, 1))  # fmt: skip
            out["rows"].append(row)
            print(fmt_row(row), flush=True)
            gpu_bench.cleanup(torch, dev)
        if shape in stage_shapes and time.time() - t_start <= args.max_s and ref is not None:
            try:
                st = stage_times(torch, data, ref, softcap, budget, args, dev, chunked_path)
            except Exception as exc:
                traceback.print_exc()
                st = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            st.update(shape=shape, N=n, H=h, V=v)
            out["stages"].append(st)
            print(fmt_stages(st), flush=True)
        elif shape in stage_shapes:
            out["skipped"].append(f"{shape}/stages")
        del data, ref
        gpu_bench.cleanup(torch, dev)
        save(args, out)
    print_tables(out)
    if out["skipped"]:
        print(f"\nskipped (past --max-s {args.max_s:.0f} s): {', '.join(out['skipped'])}")
    print(f"\ntotal wall {time.time() - t_start:.1f} s")
    save(args, out)


def _names(text):
    return [s for s in text.split(",") if s]


# -- one variant ----------------------------------------------------------------------------


def loss_fn(softcap, budget):
    from fused_ce_patch import fused_linear_cross_entropy

    def fn(hidden, weight, labels):
        return fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap,
                                          logits_budget=budget, backend="triton")  # fmt: skip

    return fn


def baseline(torch, data, softcap, budget, text, chunked_path):
    """Loss, dH and dW of the first variant (the reference of the others' errors)."""
    os.environ[chunked_path.TUNING_ENV] = text
    hidden = data["hidden"].detach().requires_grad_()
    weight = data["weight"].detach().requires_grad_()
    loss = loss_fn(softcap, budget)(hidden, weight, data["labels"])
    loss.backward()
    return {"loss": loss.detach(), "dh": hidden.grad, "dw": weight.grad}


def measure_variant(torch, data, ref, softcap, budget, text, args, dev, chunked_path):
    """``gpu_bench.measure`` with ``text`` in the tuning variable, plus the chunk plan."""
    os.environ[chunked_path.TUNING_ENV] = text
    plans = []
    original = chunked_path.plan_rows

    def spy(n_valid, rows_max):
        rows = original(n_valid, rows_max)
        plans.append((n_valid, rows))
        return rows

    chunked_path.plan_rows = spy  # run_paths looks it up at each call
    try:
        row = gpu_bench.measure(torch, loss_fn(softcap, budget), data, ref, args, dev)
    finally:
        chunked_path.plan_rows = original
    if plans:
        n_valid, rows = plans[-1]
        row.update(rows=rows, chunks=math.ceil(n_valid / rows))
    return row


# -- where the default schedule's time goes -------------------------------------------------


def timed_eager_pass(torch, chunked_path, clock):
    """The chunked path's eager pass (``chunked_path._eager_pass``, the schedule of bf16
    mean/sum losses with gradients) with a clock lap after each step; same calls, same
    order."""
    cp = chunked_path

    def _pass(cfg, hidden, weight, bias, valid_rows, y_valid, need):
        m, dev = cfg.n_valid, hidden.device
        loss_v, lse_v, nll_v, coef_v = (torch.empty(m, dtype=torch.float32, device=dev)
                                        for _ in range(4))  # fmt: skip
        grads = cp._new_grads(hidden, weight, bias, need)
        clock.start()
        for start, stop, idx, h, y, rows in cp._chunks(cfg, hidden, valid_rows, y_valid):
            clock.lap("gather")
            z = cp._logits(h, weight, bias)
            clock.lap("logits mm")
            cfg.launchers.logits_grad(
                z, y, lse_v[start:stop], nll_v[start:stop], loss_v[start:stop],
                coef_v[start:stop], cfg.scale, cfg.spec, compute_lse=True, write_grad=True,
            )  # fmt: skip
            clock.lap("row kernel")
            if grads.dw is not None and grads.dw_fresh:  # as cp._backprop_chunk
                torch.mm(z.t(), h, out=grads.dw)
                grads.dw_fresh = False
            elif grads.dw is not None:
                grads.dw.addmm_(z.t(), h)
            clock.lap("dW addmm")
            if grads.db is not None:
                grads.db += z.sum(0, dtype=torch.float32)
            clock.lap("db")
            if grads.dh is not None:
                z.scatter_(1, y.unsqueeze(1), coef_v[start:stop].unsqueeze(1).to(z.dtype))
                part = cp._mm_fp32(z, weight)
                clock.lap("dH mm")
                if rows is not None:
                    grads.dh[rows].copy_(part)
                else:
                    grads.dh.index_copy_(0, idx, part.to(grads.dh.dtype))
                clock.lap("dH copy")
                del part
            del z, h
        cp._finish(cfg.launchers, grads, hidden, valid_rows, y_valid, coef_v)
        clock.lap("target dW")
        return loss_v, lse_v, nll_v, grads

    return _pass


def stage_times(torch, data, ref, softcap, budget, args, dev, chunked_path):
    """Per-step time of the default schedule (median over runs), the whole fwd+bwd, and the
    check that the timed copy computes what the driver does."""
    from fused_ce_patch.numerics import relative_error as rel

    os.environ.pop(chunked_path.TUNING_ENV, None)
    original = chunked_path._eager_pass
    hidden = data["hidden"].detach().requires_grad_()
    weight = data["weight"].detach().requires_grad_()
    fn = loss_fn(softcap, budget)
    runs, totals, errs = [], [], None
    try:
        for i in range(max(1, args.stage_iters) + 1):  # the first run compiles / warms up
            clock = Laps(dev)
            chunked_path._eager_pass = timed_eager_pass(torch, chunked_path, clock)
            whole = Laps(dev)
            whole.start()
            loss = fn(hidden, weight, data["labels"])
            loss.backward()
            whole.lap("fwd+bwd")
            if i == 0:
                errs = {"err_loss": rel(loss.detach(), ref["loss"]),
                        "err_dh": rel(hidden.grad, ref["dh"]),
                        "err_dw": rel(weight.grad, ref["dw"])}  # fmt: skip
            else:
                runs.append(clock.totals())
                totals.append(whole.totals()["fwd+bwd"])
            hidden.grad = weight.grad = None
            del loss
    finally:
        chunked_path._eager_pass = original
    names = list(runs[0])
    ms = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in names}
    m = int((data["labels"] != -100).sum())
    n_h, n_v = hidden.shape[1], weight.shape[0]
    flop = 2 * m * n_h * n_v
    out = {"ms": ms, "fwd_bwd_ms": statistics.median(totals), **errs}
    out["other_ms"] = out["fwd_bwd_ms"] - sum(ms.values())
    out["tflops"] = {k: flop / ms[k] / 1e9 for k in ("logits mm", "dW addmm", "dH mm")
                     if ms.get(k)}  # fmt: skip
    if ms.get("row kernel"):  # logits read twice, written once (bf16)
        out["row_kernel_gbs"] = 3 * m * n_v * 2 / ms["row kernel"] / 1e6
    return out


# -- output ---------------------------------------------------------------------------------


def fmt_row(r):
    head = f"{r['shape']:<15} {r['variant']:<14}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    parts = [f"{head} {r['ms']:8.2f} ms"]
    if "extra_mib" in r:
        parts.append(f"{r['extra_mib']:7.1f} MiB")
    if "chunks" in r:
        parts.append(f"{r['chunks']:3d} x {r['rows']:5d} rows")
    if "err_dh" in r:
        parts.append(f"loss {r['err_loss']:.1e} dH {r['err_dh']:.1e} dW {r['err_dw']:.1e}")
    return "  ".join(parts)


def fmt_stages(s):
    if "error" in s:
        return f"stages {s['shape']}: ERROR {s['error']}"
    steps = ", ".join(f"{k} {v:.2f}" for k, v in s["ms"].items())
    return (f"stages {s['shape']} (ms): {steps}, other {s['other_ms']:.2f}; "
            f"fwd+bwd {s['fwd_bwd_ms']:.2f}; check vs base: loss {s['err_loss']:.1e} "
            f"dH {s['err_dh']:.1e} dW {s['err_dw']:.1e}")  # fmt: skip


def print_tables(out):
    rows = out["rows"]
    base = {r["shape"]: r["ms"] for r in rows
            if "ms" in r and r["tuning"] is not None and r is _first(rows, r["shape"])}  # fmt: skip
    print("\n| shape | variant | ms (median) | vs first | extra MiB | chunks x rows | "
          "err loss | err dH | err dW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['variant']} | error: {r['error'][:80]} | | | | | | |")
            continue
        d = f"{100 * (r['ms'] / base[r['shape']] - 1):+.1f}%" if r["shape"] in base else ""
        x = f"{r['extra_mib']:.0f}" if "extra_mib" in r else ""
        c = f"{r['chunks']} x {r['rows']}" if "chunks" in r else ""
        e = [f"{r[k]:.1e}" if k in r else "" for k in ("err_loss", "err_dh", "err_dw")]
        print(f"| {r['shape']} | {r['variant']} | {r['ms']:.2f} | {d} | {x} | {c} | "
              f"{e[0]} | {e[1]} | {e[2]} |")  # fmt: skip
    for s in out["stages"]:
        if "error" in s:
            continue
        print(f"\nStages of the default schedule, {s['shape']} (ms, summed over chunks; "
              f"median of runs):")
        print("| step | ms | share | TFLOP/s |")
        print("|---|---|---|---|")
        for k, v in [*s["ms"].items(), ("other (outside the pass)", s["other_ms"])]:
            tf = f"{s['tflops'][k]:.0f}" if k in s["tflops"] else ""
            print(f"| {k} | {v:.2f} | {100 * v / s['fwd_bwd_ms']:.0f}% | {tf} |")
        print(f"| fwd+bwd | {s['fwd_bwd_ms']:.2f} | | |")
        if "row_kernel_gbs" in s:
            print(f"row kernel: {s['row_kernel_gbs']:.0f} GB/s (3 passes over bf16 logits)")


def _first(rows, shape):
    return next(r for r in rows if r["shape"] == shape and r["tuning"] is not None)


def save(args, out):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_overlap.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
