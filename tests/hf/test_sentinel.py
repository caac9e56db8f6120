"""The guarded ``outputs.logits`` placeholder of the fused path."""

from __future__ import annotations

import copy
import operator
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fused_ce_patch import LogitsNotMaterializedError, apply_fused_ce
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from hf_helpers import batch, build_model


@pytest.fixture
def logits():
    return NotMaterializedLogits((2, 16, 1003))


def _explains(exc: BaseException):
    msg = str(exc)
    assert "model.eval()" in msg
    assert "return_logits=True" in msg
    assert "FUSED_CE_RETURN_LOGITS=1" in msg


USES = {
    "index": lambda x: x[0],
    "slice": lambda x: x[..., :-1, :],
    "shape": lambda x: x.shape,
    "dtype": lambda x: x.dtype,
    "float": lambda x: x.float(),
    "argmax": lambda x: x.argmax(-1),
    "size": lambda x: x.size(),
    "add": lambda x: x + 1,
    "radd": lambda x: 1 + x,
    "mul": lambda x: x * 2,
    "truediv": lambda x: x / 30.0,
    "matmul": lambda x: x @ torch.ones(3),
    "neg": lambda x: -x,
    "lt": lambda x: x < 0,
    "eq_tensor": lambda x: x == torch.zeros(1),
    "iadd": lambda x: operator.iadd(x, 1),
    "torch.tanh": lambda x: torch.tanh(x),
    "torch.softmax": lambda x: torch.softmax(x, -1),
    "F.cross_entropy": lambda x: F.cross_entropy(x, torch.zeros(2, dtype=torch.long)),
    "torch.cat": lambda x: torch.cat([x, x]),
    "tensor.add": lambda x: torch.zeros(1).add(x),
    "numpy": lambda x: np.asarray(x),
    "len": lambda x: len(x),
    "iter": lambda x: list(x),
    "bool": lambda x: bool(x),
    "float()": lambda x: float(x),
    "setattr": lambda x: setattr(x, "foo", 1),
}


@pytest.mark.parametrize("use", USES)
def test_any_tensor_use_raises(logits, use):
    with pytest.raises(LogitsNotMaterializedError) as info:
        USES[use](logits)
    _explains(info.value)
    assert isinstance(info.value, RuntimeError)


def test_harmless_uses_do_not_raise(logits):
    assert "NotMaterializedLogits" in repr(logits) and "1003" in str(logits)
    assert f"{logits}" == str(logits)
    assert logits is not None and not (logits is None)
    assert logits != None  # noqa: E711 - comparing with None must not raise
    assert not isinstance(logits, torch.Tensor)
    # attribute probes answer "absent" (accelerate probes `hasattr(x, "dtype")`)
    assert not hasattr(logits, "dtype")
    assert getattr(logits, "shape", "absent") == "absent"
    assert copy.copy(logits) is logits and copy.deepcopy(logits) is logits
    assert isinstance(pickle.loads(pickle.dumps(logits)), NotMaterializedLogits)
    assert logits == NotMaterializedLogits()
    assert len({logits}) == 1


def test_model_output_and_accelerate_conversion(spy):
    from accelerate.utils import convert_to_fp32
    from accelerate.utils.operations import send_to_device

    model = build_model("llama")
    apply_fused_ce(model)
    out = model(**batch(), use_cache=False)
    assert spy.count == 1
    assert isinstance(out.logits, NotMaterializedLogits)
    assert out["logits"] is out.logits
    assert list(out.keys()) == ["loss", "logits"]
    assert out.to_tuple()[1] is out.logits

    converted = convert_to_fp32(out)  # what accelerate's AMP wrapper applies to outputs
    assert type(converted) is type(out) and converted.logits is out.logits
    assert torch.equal(converted.loss, out.loss)
    moved = send_to_device(out, "cpu")
    assert moved.logits is out.logits

    with pytest.raises(LogitsNotMaterializedError) as info:
        out.logits[..., :-1, :].argmax(-1)
    _explains(info.value)
    assert "[2, 16, 1003]" in str(info.value)


def test_error_types_are_catchable():
    from fused_ce_patch.hf.sentinel import LogitsAttributeError, LogitsTypeError

    assert issubclass(LogitsAttributeError, LogitsNotMaterializedError)
    assert issubclass(LogitsAttributeError, AttributeError)
    assert issubclass(LogitsTypeError, LogitsNotMaterializedError)
    assert issubclass(LogitsTypeError, TypeError)


def test_numeric_format_raises_and_weakref_works(logits):
    import weakref

    with pytest.raises(LogitsNotMaterializedError):
        f"{logits:.3f}"
    assert "NotMaterializedLogits" in f"{logits}"
    assert weakref.ref(logits)() is logits
