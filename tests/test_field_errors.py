"""The four errors that name a field share one base: ``field`` names what to
change and ``reason`` says why, with the messages each had before."""

from __future__ import annotations

import pickle

import pytest

from diffrt.engine import EngineConfig, EngineConfigError, InvalidRequestError, SamplingParams
from diffrt.engine.parallel import ParallelConfigError
from diffrt.field_error import FieldError
from diffrt.runtime.types import DeclaredValueError


@pytest.mark.parametrize("cls, message", [
    (InvalidRequestError, "height: must be positive"),
    (EngineConfigError, "height: must be positive"),
    (DeclaredValueError, "height: must be positive"),
    (ParallelConfigError, "must be positive"),  # its reason says it whole
])
def test_each_is_a_field_error_with_its_message(cls, message):
    error = cls("height", "must be positive")
    assert isinstance(error, FieldError) and isinstance(error, ValueError)
    assert (error.field, error.reason, str(error)) == ("height", "must be positive", message)
    copy = pickle.loads(pickle.dumps(error))  # a worker's or Ray's error keeps its field
    assert type(copy) is cls and (copy.field, str(copy)) == ("height", message)


def test_the_errors_raised_name_their_fields():
    with pytest.raises(FieldError) as info:
        SamplingParams(height=64, width=64, num_inference_steps=0, guidance_scale=1.0,
                       true_cfg_scale=1.0).validate()
    assert type(info.value) is InvalidRequestError and info.value.field == "num_inference_steps"
    with pytest.raises(FieldError) as info:
        EngineConfig(model="toy", max_num_seqs=0)
    assert type(info.value) is EngineConfigError and info.value.field == "max_num_seqs"
