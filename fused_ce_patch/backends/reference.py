"""Backend ``"reference"``: the oracle every other backend answers to.

Materialises the whole ``[N, V]`` logits in float32 (float64 for float64 inputs), applies the
softcap, and calls ``torch.nn.functional.cross_entropy``; autograd does the backward. Memory is
``O(N * V)``: for tests and debugging only, never chosen by ``"auto"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Backend, Problem

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ReferenceBackend(Backend):
    name = "reference"
    priority = -100
    auto = False
    device_types = ()

    def accepts(self, device, dtype):
        if dtype not in _FLOATS:
            return False, f"dtype {dtype} is not a floating type"
        return True, ""

    def run(self, problem: Problem) -> torch.Tensor:
        spec = problem.spec
        acc = torch.float64 if problem.weight.dtype == torch.float64 else torch.float32
        hidden = problem.hidden.reshape(-1, problem.hidden_size).to(acc)
        logits = hidden @ problem.weight.to(acc).t()
        if problem.bias is not None:
            logits = logits + problem.bias.to(acc)
        if spec.softcap is not None:
            logits = spec.softcap * torch.tanh(logits / spec.softcap)
        loss = F.cross_entropy(
            logits,
            problem.labels,
            ignore_index=spec.ignore_index,
            reduction="none",
            label_smoothing=spec.label_smoothing,
        )
        if spec.z_loss:
            counted = problem.labels != spec.ignore_index
            loss = loss + spec.z_loss * torch.logsumexp(logits, dim=-1).square() * counted
        if problem.reduction == "none":
            return loss
        return loss.sum() * problem.scale
