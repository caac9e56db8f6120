"""CPU benchmark: peak memory of TRL's own head computation against fused_ce_patch's routed one.

Question: when TRL's trainers compute their per-token log-probabilities with fused_ce_patch
(a patched model: ``hf/trl.py`` routes TRL's kernel calls), is the peak memory ever above
what TRL's own computation needs at the same call? (issue 23 §3: the tile policy,
``fused_ce_patch.tile_policy``.)

Implementations, each a forward + backward of one head call ``(hidden [N, H], weight [V, H])``
as the trainer makes it (float32, TRL's CPU default):

    trl-1.16        trl.kernels.ChunkedLogProbFunction (trl >= 1.15's fused head; on CPU its
                    torch tile fallback), chunk 32768, the trainer's ``outputs``
    ours            fused_linear_token_stats with what the router passes for that call
                    (``replaces`` = TRL's [4096, 32768] tile): the default since the policy
    ours-before     the same call on the code before the policy (``--before``: a checkout of
                    commit 438003b, e.g. ``git archive 438003b fused_ce_patch | tar -x -C DIR``)
    trl-1.14-nll    trl 1.14 ``sft_trainer._chunked_cross_entropy_loss`` (``chunked_nll``,
                    256-row chunks; ``--trl14``: a folder holding trl 1.14's ``trl`` package,
                    e.g. the unzipped wheel: it is pure Python)
    ours-nll        what the router computes for it (``replaces`` = the 256-row float32 chunk)
    ours-nll-before the same on the code before the policy

Shapes (tiny Llama head: H=576, V=49152, SmolLM2-135M's): ``N`` rows as each trainer hands
them to the head in the tests' runs: KTO 310, GRPO/RLOO 162 (``outputs``: KTO log_probs,
entropy, mean_logits; GRPO/RLOO log_probs, entropy; SFT log_probs, entropy, is_top1), SFT 2046
(two 1024-token sequences). The upstream gradient of the log-probs is one value per token
(SFT) or a fixed per-token weight in [-1, 1] (KTO, GRPO/RLOO), plus 0.01 x entropy.

Method (as ``cpu_chunked.py``): every measurement in a fresh subprocess with glibc told to
``mmap`` allocations above 64 KiB (freed buffers leave the resident set at once); inputs
built, one warm-up step, grads dropped, the peak-RSS mark reset (``/proc/self/clear_refs``),
one timed step. **peak extra** = ``VmHWM`` - ``VmRSS`` before the step: every byte the step
needs on top of its inputs, including the gradients it returns (dW: 108 MiB, dH: N x 2.25 KiB,
the same for all). Implementations alternate over ``--rounds`` rounds; the table gives the
largest peak and the smallest CPU time per thread of the rounds.

Usage::

    python benchmarks/cpu_trl_rss.py --before /tmp/before --trl14 /tmp/trl-1.14.0

Writes ``benchmarks/results/cpu_trl_rss.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from fused_ce_patch.demo.memory import current_rss, peak_rss, reset_peak  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
H, V = 576, 49152
SHAPES = {  # name: (rows into the head, TRL outputs, per-token weights)
    "KTO": (310, ("log_probs", "entropy", "mean_logits"), True),
    "GRPO/RLOO": (162, ("log_probs", "entropy"), True),
    "SFT": (2046, ("log_probs", "entropy", "is_top1"), False),
}
IMPLS = ("trl-1.16", "ours", "ours-before", "trl-1.14-nll", "ours-nll", "ours-nll-before")
MiB = 2**20


# -- worker (its own process) ----------------------------------------------------------------


def _step_fn(impl: str, outputs, weighted: bool, n: int):
    import torch

    from fused_ce_patch import fused_linear_token_stats

    g = torch.Generator().manual_seed(1)
    weights = torch.rand(n, generator=g) * 2 - 1 if weighted else torch.full((n,), 1.0 / n)

    def finish(log_probs, entropy):
        loss = -(log_probs * weights).sum()
        if entropy is not None:
            loss = loss + 0.01 * entropy.sum()
        loss.backward()

    if impl == "trl-1.16":
        from trl.kernels import ChunkedLogProbFunction

        def step(hidden, weight, labels):
            out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 32768, None,
                                               1.0, outputs)
            finish(out[0], out[1])

        return step
    if impl in ("ours", "ours-before"):
        kw = {}
        if impl == "ours":  # what hf/trl.py's router passes for TRL's call
            import trl.kernels

            from fused_ce_patch.hf.trl import _logprob_tiling

            kw["replaces"] = _logprob_tiling(trl.kernels.ChunkedLogProbFunction, 32768)

        def step(hidden, weight, labels):
            s = fused_linear_token_stats(
                hidden, weight, labels, entropy="entropy" in outputs,
                accuracy="is_top1" in outputs, mean_logits="mean_logits" in outputs,
                backend="torch", **kw)
            finish(s.log_probs, s.entropy)

        return step
    if impl == "trl-1.14-nll":
        from trl.trainer.sft_trainer import _chunked_cross_entropy_loss

        def step(hidden, weight, labels):
            loss, _, _, _ = _chunked_cross_entropy_loss(hidden[None], weight, 256,
                                                        shift_labels=labels[None])
            loss.backward()

        return step
    if impl in ("ours-nll", "ours-nll-before"):
        kw = {}
        if impl == "ours-nll":
            from fused_ce_patch.hf.trl import _chunked_nll_tiling

            kw["replaces"] = _chunked_nll_tiling(256)

        def step(hidden, weight, labels):
            # as the router: log-probs, entropy and top-1, loss = mean negative log-prob
            s = fused_linear_token_stats(hidden, weight, labels, entropy=True, accuracy=True,
                                         backend="torch", **kw)
            (-s.log_probs.sum() / s.mask.sum()).backward()

        return step
    raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")


def worker(impl: str, shape: str) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n, outputs, weighted = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H**-0.5).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g)
    step = _step_fn(impl, outputs, weighted, n)
    step(hidden, weight, labels)  # warm-up
    hidden.grad = weight.grad = None
    if not reset_peak():
        raise RuntimeError("this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs)")
    base = current_rss()
    c0, t0 = time.process_time(), time.perf_counter()
    step(hidden, weight, labels)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    peak = peak_rss()
    import fused_ce_patch

    return {"impl": impl, "shape": shape, "N": n, "H": H, "V": V,
            "peak_extra_mib": (peak - base) / MiB, "wall_s": wall,
            "cpu_s_per_thread": cpu / torch.get_num_threads(),
            "grads_mib": (hidden.numel() + weight.numel()) * 4 / MiB,
            "fused_ce_patch_from": str(Path(fused_ce_patch.__file__).parent.parent)}


# -- driver ----------------------------------------------------------------------------------


def _run(impl, shape, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    path = [str(REPO)]
    if impl.endswith("-before"):
        path = [args.before]
    if impl == "trl-1.14-nll":
        path = [args.trl14, str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, __file__, "--worker", impl, shape], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"impl": impl, "shape": shape, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "SHAPE"), help=argparse.SUPPRESS)
    p.add_argument("--before", help="folder holding the pre-policy fused_ce_patch package")
    p.add_argument("--trl14", help="folder holding trl 1.14's trl package")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return None
    impls = [i for i in IMPLS
             if not (i.endswith("-before") and not args.before)
             and not (i == "trl-1.14-nll" and not args.trl14)]
    shapes = args.shapes.split(",")
    load = os.getloadavg()
    rows = []
    for r in range(args.rounds):
        for shape in shapes:
            for impl in impls:
                row = _run(impl, shape, args)
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "python": platform.python_version(), "machine": platform.machine(),
           "nproc": os.cpu_count(), "threads": args.threads,
           "load_before": load, "load_after": os.getloadavg()}
    try:
        import torch
        import trl

        env.update(torch=torch.__version__, trl=trl.__version__)
    except ImportError:
        pass
    table = summarise(rows, shapes, impls)
    print_table(table, env)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_trl_rss.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "table": table}, f, indent=1)
    plot(table, shapes, impls, os.path.join(args.out, "cpu_trl_rss.png"))
    return table


def summarise(rows, shapes, impls):
    table = []
    for shape in shapes:
        for impl in impls:
            got = [r for r in rows if r["shape"] == shape and r["impl"] == impl]
            ok = [r for r in got if "error" not in r]
            if not ok:
                table.append({"shape": shape, "impl": impl,
                              "error": got[0].get("error") if got else "not run"})
                continue
            table.append({"shape": shape, "impl": impl, "N": ok[0]["N"],
                          "peak_extra_mib": max(r["peak_extra_mib"] for r in ok),
                          "cpu_s": min(r["cpu_s_per_thread"] for r in ok),
                          "grads_mib": ok[0]["grads_mib"]})
    stock = {"ours": "trl-1.16", "ours-before": "trl-1.16", "trl-1.16": "trl-1.16",
             "ours-nll": "trl-1.14-nll", "ours-nll-before": "trl-1.14-nll",
             "trl-1.14-nll": "trl-1.14-nll"}
    for row in table:
        ref = next((r for r in table if r["shape"] == row["shape"]
                    and r["impl"] == stock[row["impl"]] and "error" not in r), None)
        if ref is not None and "error" not in row:
            row["vs_stock"] = row["peak_extra_mib"] / ref["peak_extra_mib"]
            row["time_vs_stock"] = row["cpu_s"] / ref["cpu_s"]
    return table


def print_table(table, env):
    print("\n" + json.dumps(env))
    print("\n| shape (N) | implementation | peak extra (MiB) | vs stock | CPU time / thread (s) "
          "| vs stock |")
    print("|---|---|---:|---:|---:|---:|")
    for r in table:
        if "error" in r:
            print(f"| {r['shape']} | {r['impl']} | error: {r['error'][:80]} | | | |")
            continue
        vs = f"{r['vs_stock']:.2f}x" if "vs_stock" in r else "-"
        tv = f"{r['time_vs_stock']:.2f}x" if "time_vs_stock" in r else "-"
        print(f"| {r['shape']} ({r['N']}) | {r['impl']} | {r['peak_extra_mib']:.0f} | {vs} | "
              f"{r['cpu_s']:.3f} | {tv} |")


def plot(table, shapes, impls, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ys = [next((r.get("peak_extra_mib", 0) for r in table
                    if r["shape"] == s and r["impl"] == impl), 0) for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], ys, width, label=impl)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(shapes))])
    ax.set_xticklabels(shapes)
    ax.set_ylabel("peak extra RSS, fwd+bwd (MiB, incl. 108 MiB dW)")
    ax.set_title(f"TRL head on CPU: stock vs fused_ce_patch (H={H}, V={V}, float32)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
