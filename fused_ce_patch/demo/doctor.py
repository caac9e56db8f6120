"""``python -m fused_ce_patch doctor``: what is installed, what is seen, what runs, and is it right.

The report has four parts:

1. versions of Python, torch, triton, transformers, accelerate, peft (and gguf, for the demo);
2. the devices torch can see (CPU always; CUDA/ROCm, Ascend NPU, MPS, XPU where present —
   ``torch_npu`` is imported only when it is installed);
3. for each device, every backend with whether it can run there and why not, and the one
   ``backend="auto"`` picks (after ``$FUSED_CE_BACKEND``);
4. a quick numeric check of every backend that can run on each device: loss and the gradients
   of hidden and weight on a small random problem with ignored rows, softcap and label
   smoothing, against a float64 evaluation of the reference backend.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import warnings
from dataclasses import dataclass

import torch

from ..numerics import relative_error

#: Relative-error limits of the numeric check, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass
class Check:
    """One backend on one device and dtype: the errors against float64 and the verdict."""

    device: str
    backend: str
    dtype: torch.dtype
    errors: dict[str, float]
    message: str = ""

    @property
    def passed(self) -> bool:
        if self.message:
            return False
        return all(err <= TOLERANCE[self.dtype] for err in self.errors.values())


def versions() -> dict[str, str]:
    """Installed versions of the libraries the plugin works with ("-" when absent)."""
    found = {"python": platform.python_version()}
    for dist in ("fused_ce_patch", "torch", "triton", "transformers", "accelerate", "peft", "gguf"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "-"
    return found


def devices() -> list[tuple[torch.device, str]]:
    """Devices torch can use here, each with a short description."""
    seen = [(torch.device("cpu"), f"{platform.machine()}, {torch.get_num_threads()} threads")]
    if torch.cuda.is_available():
        kind = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            seen.append((torch.device("cuda", i), f"{torch.cuda.get_device_name(i)}, {kind}"))
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
            if torch.npu.is_available():
                for i in range(torch.npu.device_count()):
                    seen.append((torch.device("npu", i), torch.npu.get_device_name(i)))
        except Exception as exc:  # a broken torch_npu install is worth reporting, not crashing on
            warnings.warn(f"torch_npu is installed but failed to initialise: {exc}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        seen.append((torch.device("mps"), "Apple Metal"))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        for i in range(xpu.device_count()):
            seen.append((torch.device("xpu", i), xpu.get_device_name(i)))
    return seen


def numeric_check(backend: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Check:
    """Loss and gradients of ``backend`` against a float64 reference on a small problem.

    The problem: 67 rows (every 7th with ``ignore_index``), hidden size 48, vocabulary 1003
    (prime, so no block size divides it), raw logits of standard deviation 20 so that softcap
    30 bends many of them, label smoothing 0.1. The float64 reference is evaluated on the
    same (rounded) inputs, so the check judges the backend's arithmetic, not input rounding.
    """
    from fused_ce_patch import fused_linear_cross_entropy

    gen = torch.Generator().manual_seed(seed)
    n, h, v = 67, 48, 1003
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * 20 / h**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::7] = -100
    options = dict(softcap=30.0, label_smoothing=0.1)

    def loss_and_grads(name, h_in, w_in):
        h_in = h_in.detach().requires_grad_(True)
        w_in = w_in.detach().requires_grad_(True)
        target = labels.to(h_in.device)
        loss = fused_linear_cross_entropy(h_in, w_in, target, backend=name, **options)
        loss.backward()
        return loss.detach(), h_in.grad, w_in.grad

    # The reference sees the same rounded inputs, so only the backend's arithmetic is judged.
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ref = loss_and_grads("reference", hidden.double(), weight.double())
    try:
        got = loss_and_grads(backend, hidden.to(device), weight.to(device))
    except Exception as exc:
        return Check(str(device), backend, dtype, {}, f"{type(exc).__name__}: {exc}")
    names = ("loss", "d_hidden", "d_weight")
    errors = {k: relative_error(g, r) for k, g, r in zip(names, got, ref)}
    return Check(str(device), backend, dtype, errors)


def report() -> tuple[str, bool]:
    """The doctor's report as text, and whether every numeric check passed."""
    from fused_ce_patch import backends
    from fused_ce_patch.errors import BackendUnavailableError

    out = ["fused_ce_patch doctor", "", "Versions:"]
    for name, version in versions().items():
        out.append(f"  {name:<15} {version}")
    env = os.environ.get(backends.registry.ENV_VAR, "")
    out.append(f"  ${backends.registry.ENV_VAR} = {env or '(unset)'}")
    if os.environ.get("TRITON_INTERPRET"):
        out.append(f"  $TRITON_INTERPRET = {os.environ['TRITON_INTERPRET']}")

    seen = devices()
    out += ["", "Devices:"]
    out += [f"  {str(dev):<8} {about}" for dev, about in seen]

    registered = set()
    for name in backends.backend_names():
        try:
            backends.get_backend(name)
            registered.add(name)
        except ValueError:  # "auto", or a name of docs/design.md with no module in this install
            pass
    checks: list[Check] = []
    out += ["", "Backends (float32). backend=\"auto\" takes $FUSED_CE_BACKEND when set, else the",
            "highest-priority backend made for the device type that can run on it:"]
    for dev, _ in seen:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                chosen = backends.resolve("auto", dev, torch.float32).name
            except BackendUnavailableError as exc:
                chosen = f"none ({exc})"
        note = f"; {caught[0].message}" if caught else ""
        out.append(f"  {dev}: auto -> {chosen}{note}")
        rows = {name: (ok, why) for name, ok, why in backends.explain(dev, torch.float32)}
        for name in backends.backend_names():
            if name == "auto":
                continue
            if name not in registered:
                out.append(f"    {name:<10} not available: not part of this installation yet")
                continue
            ok, why = rows[name]
            out.append(f"    {name:<10} {'can run' if ok else 'cannot run: ' + why}")
        for dtype in (torch.float32, torch.bfloat16):
            for name, ok, _ in backends.explain(dev, dtype):
                if ok:
                    checks.append(numeric_check(name, dev, dtype))

    out += ["", "Numeric check vs float64 reference (rel. error of loss, d_hidden, d_weight;",
            "67 rows incl. ignored, H=48, V=1003, logits std 20, softcap 30, label smoothing 0.1):"]
    for c in checks:
        dtype = str(c.dtype).replace("torch.", "")
        verdict = "PASS" if c.passed else "FAIL"
        if c.message:
            detail = c.message
        else:
            detail = ", ".join(f"{k} {e:.1e}" for k, e in c.errors.items())
            detail += f" (limit {TOLERANCE[c.dtype]:g})"
        out.append(f"  {verdict}  {c.device:<6} {c.backend:<10} {dtype:<9} {detail}")
    all_ok = all(c.passed for c in checks) and bool(checks)
    out += ["", "All checks passed." if all_ok else "SOME CHECKS FAILED."]
    return "\n".join(out), all_ok


def run_doctor() -> int:
    """Print the report; exit status 0 when every numeric check passed."""
    text, ok = report()
    print(text)
    return 0 if ok else 1
