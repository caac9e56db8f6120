"""The loss's label check, started when a patched forward starts.

Before it runs, the fused loss reads a few numbers of its labels on the host: the smallest
and largest counted label (a label outside ``[0, V)`` raises
:class:`~fused_ce_patch.errors.LabelOutOfRangeError` instead of a device assert), how many
labels count (the mean's divisor and the chunk plan) and the value of a ``num_items_in_batch``
tensor. Read at the loss, that host read waits until the device has run the whole forward:
the queue of launched work drains, and the device then idles while the host launches the
loss and the backward. Where the host launches barely faster than the device runs (a small
model at a small batch, compiled) the step never gets that lead back: 6 % of a compiled
SmolLM2-135M step at 4x2048 tokens on an H200 (issue 39).

:func:`start`, called by a patched forward before the decoder runs, computes the same numbers
on the device at once (the labels are ready then) and copies them to pinned host memory
without waiting. :func:`take`, called by the loss, then waits only for that copy, which the
device ran before the forward. The numbers are those the loss would compute; :func:`take`
returns None (the loss computes them itself, as before) unless the call is the one they were
computed for: the same labels tensor (address, shape, strides and version counter), the same
``ignore_index`` and shift, and the same ``num_items_in_batch`` tensor.

Under ``torch.compile`` :func:`start` is the custom op ``fused_ce::label_stats`` (tagged
``cudagraph_unsafe``, as the loss's ops), placed where the forward calls it, and its host
tensor is an input of the loss's op, so the two stay in one graph in that order.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import struct
import threading

import torch
from torch import Tensor
from torch.library import custom_op

from . import errors

# Slots of the host tensor: the device-computed numbers, then what the host knew at start.
_LO, _HI, _COUNT, _ITEMS_BITS = 0, 1, 2, 3
_SEQ, _IGNORE, _SHIFT, _LAYOUT, _PTR, _VERSION, _ITEMS_PTR, _ITEMS_VERSION = range(4, 12)
_SLOTS = 12
_NO_ITEMS = -1

#: Copies in flight or done, by sequence number: the CUDA event after the copy (None: the
#: numbers were computed on the host). Bounded: an entry whose loss never ran is dropped.
_READY: collections.OrderedDict = collections.OrderedDict()
_KEEP = 64
_LOCK = threading.Lock()
_SEQS = itertools.count(1)


def _layout(labels: Tensor) -> int:
    """A number for ``labels``' shape, strides and offset: the same memory read as another
    shape (a view) shifts other positions out."""
    return hash((tuple(labels.shape), labels.stride(), labels.storage_offset())) % 2**62


def _version(t: Tensor) -> int:
    """``t``'s version counter; inference tensors have none (-2: they cannot change outside
    inference mode, where the fused loss does not run)."""
    return -2 if t.is_inference() else t._version


def device_stats(labels: Tensor, ignore_index: int, num_items: Tensor | None = None) -> Tensor:
    """``[lo, hi, count(, num_items bits)]`` of flat int64 ``labels`` on their device, int64.

    ``lo``/``hi``: smallest and largest label, each ``ignore_index`` read as 0 (always in
    range, so the range check is that of the counted labels); ``count``: how many labels are
    not ``ignore_index``; ``num_items`` (a 0-d float32 tensor on the
    labels' device) rides along as its float32 bit pattern. No host synchronisation.
    """
    counted = labels != ignore_index
    lo, hi = torch.aminmax(torch.where(counted, labels, 0))
    stats = [lo, hi, counted.sum()]
    if num_items is not None:
        stats.append(num_items.view(torch.int32).to(torch.int64))
    return torch.stack(stats)


def _items_tensor(num_items, device) -> Tensor | None:
    """A ``num_items_in_batch`` tensor that rides with the labels' read, else None."""
    if not isinstance(num_items, Tensor) or num_items.numel() != 1 or num_items.device != device:
        return None
    if num_items.is_complex() or num_items.dtype == torch.bool or num_items.requires_grad:
        return None  # the loss refuses these with its own message
    return num_items.detach().reshape(()).to(torch.float32)


def _compute(labels: Tensor, ignore_index: int, shift: bool, num_items: Tensor | None) -> Tensor:
    """The host tensor for ``labels`` (int64), computed now; its copy is not waited for."""
    host = torch.empty(_SLOTS, dtype=torch.int64, pin_memory=labels.device.type == "cuda")
    items = _items_tensor(num_items, labels.device)
    counted_labels = labels[..., 1:] if shift else labels  # the shifted-in pad never counts
    stats = device_stats(counted_labels.reshape(-1), ignore_index, items)
    seq = next(_SEQS)
    host.numpy()[_SEQ:] = (  # host memory: written through NumPy, no torch op per call
        seq, ignore_index, int(shift), _layout(labels), labels.data_ptr(), _version(labels),
        num_items.data_ptr() if items is not None else _NO_ITEMS,
        _version(num_items) if items is not None else _NO_ITEMS,
    )
    event = None
    if labels.device.type == "cuda":
        host[: stats.shape[0]].copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(labels.device))  # the copy's stream
    else:
        host[: stats.shape[0]].copy_(stats)  # a host or other device: the copy itself waits
    with _LOCK:
        _READY[seq] = event
        while len(_READY) > _KEEP:
            _READY.popitem(last=False)
    return host


def start(labels, *, ignore_index=-100, shift=True, num_items_in_batch=None) -> Tensor | None:
    """Start the loss's label read for ``labels``; the host tensor for :func:`take`, or None
    where there is nothing to start (labels not an int64 tensor with data, no position left
    to count, a device that is capturing a CUDA graph, inside ``torch.func`` transforms).

    Args:
        labels: the labels the forward will give its loss (``shift_labels`` when given).
        ignore_index: the loss's ``ignore_index``.
        shift: whether the loss shifts ``labels`` (drops the first position of each row).
        num_items_in_batch: the loss's ``num_items_in_batch``; a one-element tensor on the
            labels' device has its value read with the labels.
    """
    if not isinstance(labels, Tensor) or labels.dtype != torch.int64 or labels.is_meta:
        return None
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        return None
    if labels.numel() == 0 or (shift and (labels.dim() < 1 or labels.shape[-1] < 2)):
        return None  # nothing that counts: the loss has its own answer for that
    if torch.compiler.is_compiling():
        items = num_items_in_batch.detach() if isinstance(num_items_in_batch, Tensor) else None
        return label_stats(labels, ignore_index, bool(shift), items)
    if errors.cuda_graph_capturing(labels.device) or labels.is_inference() \
            or torch._C._functorch.is_functorch_wrapped_tensor(labels):
        return None  # (inference tensors: no version counter shows a later write)
    return _compute(labels, ignore_index, bool(shift), num_items_in_batch)


def take(host, labels: Tensor, ignore_index: int, shift: bool, num_items):
    """``(lo, hi, count, num_items)`` as Python numbers from :func:`start`'s ``host`` tensor
    when it was made for this call, after waiting for its copy (``num_items``: the float32
    value of a ``num_items_in_batch`` tensor on the labels' device, else None); None
    otherwise (``host`` None, other labels, options or ``num_items_in_batch`` tensor, or its
    copy no longer tracked)."""
    if not isinstance(host, Tensor) or host.device.type != "cpu" or host.shape != (_SLOTS,):
        return None
    meta = host.numpy()[_SEQ:].tolist()
    seq, ignore, shifted, layout, ptr, version, items_ptr, items_version = meta
    if (ignore != ignore_index or shifted != int(shift) or layout != _layout(labels)
            or ptr != labels.data_ptr() or version != _version(labels)):
        return None
    # a num_items_in_batch tensor elsewhere (the host) is read by the loss without a wait
    items_here = isinstance(num_items, Tensor) and num_items.device == labels.device
    if items_here and (items_ptr == _NO_ITEMS or items_ptr != num_items.data_ptr()
                       or items_version != _version(num_items)):
        return None
    with _LOCK:
        if seq not in _READY:
            return None
        event = _READY[seq]
    if event is not None:
        event.synchronize()
    lo, hi, count, bits = host.numpy()[:4].tolist()
    return lo, hi, count, float32_from_bits(bits) if items_here else None


def float32_from_bits(bits: int) -> float:
    """The float32 whose bit pattern is the low 32 bits of ``bits``."""
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _op_tags() -> dict:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or "tags" not in inspect.signature(custom_op).parameters:
        return {}
    return {"tags": (tag,)}


@custom_op("fused_ce::label_stats", mutates_args=(), **_op_tags())
def label_stats(labels: Tensor, ignore_index: int, shift: bool,
                num_items: Tensor | None) -> Tensor:
    """:func:`start` as one opaque op: the host tensor (int64 ``[12]``, on the CPU)."""
    return _compute(labels, ignore_index, shift, num_items)


@label_stats.register_fake
def _(labels, ignore_index, shift, num_items):
    return torch.empty(_SLOTS, dtype=torch.int64, device="cpu")
