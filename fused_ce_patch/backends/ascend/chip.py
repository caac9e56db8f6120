"""What the launch configuration needs to know about an Ascend chip, and how it is detected.

An Ascend AI core pairs one cube core (matrix unit; operands in L1/L0A/L0B, results in L0C)
with two vector cores, each with its own Unified Buffer (UB) — the on-chip memory every
Triton tile handled by vector code lives in. triton-ascend maps one program to one physical
core and reports a UB overflow at compile time ("ub overflow, requires N bits while 1572864
bits available"), so block sizes must be derived from the UB size, and grids from the core
counts.

Detection order (first that answers wins, per field):

- chip name: triton-ascend's ``driver.active.get_current_target().arch``, else
  ``torch.npu.get_device_name``.
- UB size and double buffering: ``$FUSED_CE_ASCEND_UB_CAPACITY_BITS`` (bits), else the
  deprecated ``$ASCEND_UB_CAPACITY_BITS`` (the name Liger-Kernel and flash-linear-attention
  read; honoured with a DeprecationWarning), else the chip name looked up in :data:`CHIPS`,
  else :data:`DEFAULT_UB_BYTES` with double buffering.
- core counts: ``$FUSED_CE_ASCEND_AICORES`` / ``$FUSED_CE_ASCEND_VECTORCORES``, else
  ``triton.runtime.driver.active.utils.get_device_properties(i)["num_aicore" |
  "num_vectorcore"]`` (triton-ascend's driver), else the defaults below.

For CPU tensors (the Triton interpreter, CI) nothing is queried: :data:`INTERPRETER` keeps the
Atlas A2 UB size, so block sizes follow the same rule as on the chip, and a few cores, so that
tests exercise programs that loop over several rows or tiles.

Sources: triton-ascend ``docs/en/programming_guide.md`` ("the UB size of the A2 series products
is 192 KB (1,572,864 bits)"; core counts from ``driver.active.utils.get_device_properties``;
vector-only kernels use the vector-core count, kernels with ``tl.dot`` the AI-core count);
triton-ascend ``third_party/ascend/backend/runtime/utils.py`` (192 KB for Ascend910B /
910_93, 256 KB for Ascend910_95 / Ascend950) and ``backend/compiler.py`` (``NPUOptions``:
``multibuffer`` on except when compiling for 910_95); Liger-Kernel
``ops/backends/_ascend/ub_manager.py`` (``ASCEND_UB_CAPACITY_BITS``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

#: ``(UB bytes per vector core, double-buffered by default)`` by chip-name prefix (longest
#: prefix wins).
CHIPS = {
    "Ascend910B": (192 * 1024, True),  # Atlas A2 training / inference (910B1..B4)
    "Ascend910_93": (192 * 1024, True),  # Atlas A3
    "Ascend910_95": (256 * 1024, False),
    "Ascend950": (256 * 1024, False),
}
#: UB bytes assumed for an NPU whose name is not in the table (the A2/A3 size).
DEFAULT_UB_BYTES = 192 * 1024
#: Core counts assumed when neither the environment nor triton-ascend's driver answers
#: (the smaller Atlas A2 parts: 20 AI cores, 40 vector cores).
DEFAULT_AICORES = 20
DEFAULT_VECTORCORES = 40

ENV_UB_BITS = "FUSED_CE_ASCEND_UB_CAPACITY_BITS"
#: The old, unprefixed name of :data:`ENV_UB_BITS`, still read when the new one is unset.
ENV_UB_BITS_DEPRECATED = "ASCEND_UB_CAPACITY_BITS"
ENV_AICORES = "FUSED_CE_ASCEND_AICORES"
ENV_VECTORCORES = "FUSED_CE_ASCEND_VECTORCORES"


@dataclass(frozen=True)
class ChipSpec:
    """The facts of one chip that the launch configuration depends on.

    Attributes:
        name: chip name (``torch.npu.get_device_name``), or ``"interpreter"``.
        ub_bytes: Unified Buffer bytes of one vector core.
        aicores: AI (cube) cores: the grid of kernels that use ``tl.dot``.
        vectorcores: vector cores: the grid of vector-only kernels.
        multibuffer: whether the compiler double-buffers tiles (triton-ascend's default,
            ``multibuffer=True``), which halves the UB a kernel's live tiles may use.
    """

    name: str
    ub_bytes: int
    aicores: int
    vectorcores: int
    multibuffer: bool = True


#: What CPU tensors (the Triton interpreter) are configured for.
INTERPRETER = ChipSpec("interpreter", DEFAULT_UB_BYTES, aicores=2, vectorcores=3)

_cache: dict[int, ChipSpec] = {}


def chip_facts(name: str) -> tuple[int, bool]:
    """``(UB bytes, double-buffered)`` of the chip called ``name`` (defaults if unknown)."""
    best = ""
    for prefix in CHIPS:
        if name.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return CHIPS[best] if best else (DEFAULT_UB_BYTES, True)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"${name} must be a positive integer, got {raw!r}")
    return value


def _driver_cores(index: int) -> tuple[int | None, int | None]:
    """``(num_aicore, num_vectorcore)`` from triton-ascend's driver, or Nones."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["num_aicore"]), int(props["num_vectorcore"])
    except Exception:  # upstream Triton has no such properties; no NPU; an old driver
        return None, None


def _npu_name(index: int) -> str:
    try:
        import triton

        arch = triton.runtime.driver.active.get_current_target().arch
        if isinstance(arch, str) and arch:
            return arch
    except Exception:  # upstream Triton's targets have no Ascend arch string
        pass
    try:
        return str(torch.npu.get_device_name(index))  # torch.npu exists once torch_npu imports
    except Exception:
        return "npu"


def _ub_bits() -> int | None:
    bits = _env_int(ENV_UB_BITS)
    if bits is None:
        bits = _env_int(ENV_UB_BITS_DEPRECATED)
        if bits is not None:
            warnings.warn(
                f"fused_ce_patch: ${ENV_UB_BITS_DEPRECATED} is deprecated here; set "
                f"${ENV_UB_BITS} instead (it takes precedence)",
                DeprecationWarning,
                stacklevel=4,
            )
    return bits


def with_overrides(spec: ChipSpec) -> ChipSpec:
    """``spec`` with the environment's overrides applied (UB bits, core counts)."""
    bits = _ub_bits()
    aic = _env_int(ENV_AICORES)
    aiv = _env_int(ENV_VECTORCORES)
    return ChipSpec(
        name=spec.name,
        ub_bytes=bits // 8 if bits is not None else spec.ub_bytes,
        aicores=aic if aic is not None else spec.aicores,
        vectorcores=aiv if aiv is not None else spec.vectorcores,
        multibuffer=spec.multibuffer,
    )


def detect_chip(device: torch.device) -> ChipSpec:
    """The :class:`ChipSpec` for tensors on ``device`` (cached per NPU; env read each call).

    Args:
        device: an ``npu`` device, or ``cpu`` (the interpreter: :data:`INTERPRETER`).

    Raises:
        ValueError: an override variable is set to something other than a positive integer.
    """
    if device.type != "npu":
        return with_overrides(INTERPRETER)
    index = device.index
    if index is None:
        try:
            index = torch.npu.current_device()
        except Exception:
            index = 0
    spec = _cache.get(index)
    if spec is None:
        name = _npu_name(index)
        aic, aiv = _driver_cores(index)
        ub, multibuffer = chip_facts(name)
        spec = ChipSpec(
            name=name,
            ub_bytes=ub,
            aicores=aic or DEFAULT_AICORES,
            vectorcores=aiv or DEFAULT_VECTORCORES,
            multibuffer=multibuffer,
        )
        _cache[index] = spec
    return with_overrides(spec)
