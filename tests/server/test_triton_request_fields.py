"""How the llm model reads a request's priority and timeout, and the scheduling_policy setting, without a
server: the Python backend's request is stood in for by a fake with the same methods."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.inputs import parse_llm_request, request_parameters
from pagedserve.backend.triton.settings import engine_arguments


class FakeTensor:
    def __init__(self, name: str, value: str) -> None:
        self._name, self._array = name, np.array([value.encode()], dtype=np.object_)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeRequest:
    """pb_utils.InferenceRequest as the llm model uses it: inputs(), parameters() (JSON text), timeout()."""

    def __init__(self, sampling: dict | None = None, parameters: dict | None = None, timeout_us: int = 0):
        self._inputs = [FakeTensor("text_input", "Hi")]
        if sampling is not None:
            self._inputs.append(FakeTensor("sampling_parameters", json.dumps(sampling)))
        self._parameters = json.dumps(parameters or {})
        self._timeout = timeout_us

    def inputs(self) -> list[FakeTensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters

    def timeout(self) -> int:
        return self._timeout


def test_no_priority_and_no_timeout_are_the_defaults():
    inputs = parse_llm_request(FakeRequest())
    assert (inputs.priority, inputs.timeout) == (0, None)


@pytest.mark.parametrize(("request_", "priority"), [
    (FakeRequest(sampling={"priority": -3, "max_tokens": 2}), -3),
    (FakeRequest(sampling={"priority": "7"}), 7),  # a string converts, as every sampling parameter does
    (FakeRequest(parameters={"priority": 2}), 2),  # the generate endpoint's `priority` field
    (FakeRequest(sampling={"priority": 1}, parameters={"priority": 9}), 1),  # sampling_parameters wins
    (FakeRequest(parameters={"priority": 0}), 0),  # Triton's 0: the default level
])
def test_priority_comes_from_sampling_parameters_or_the_request_parameters(request_, priority):
    inputs = parse_llm_request(request_)
    assert inputs.priority == priority
    assert inputs.params.max_tokens in (2, 16)  # the key is not a sampling parameter, and is taken out


@pytest.mark.parametrize("request_", [
    FakeRequest(sampling={"priority": 1.5}),
    FakeRequest(sampling={"priority": True}),
    FakeRequest(sampling={"priority": "high"}),
    FakeRequest(parameters={"priority": 2**64}),
])
def test_a_bad_priority_is_refused_naming_it(request_):
    with pytest.raises(InvalidRequestError) as info:
        parse_llm_request(request_)
    assert info.value.field == "priority"


def test_the_timeout_is_tritons_request_timeout_in_microseconds():
    assert parse_llm_request(FakeRequest(timeout_us=250_000)).timeout == 0.25


def test_the_generate_endpoints_timeout_field_is_microseconds_too_and_zero_is_none():
    assert parse_llm_request(FakeRequest(parameters={"timeout": 1_500_000})).timeout == 1.5
    assert parse_llm_request(FakeRequest(parameters={"timeout": 0}, timeout_us=9)).timeout is None


@pytest.mark.parametrize("timeout", [-1, 0.5, "soon", False])
def test_a_bad_timeout_field_is_refused_naming_it(timeout):
    with pytest.raises(InvalidRequestError) as info:
        parse_llm_request(FakeRequest(parameters={"timeout": timeout}))
    assert info.value.field == "timeout"


def test_priority_and_timeout_are_not_sampling_settings_for_other_models():
    assert request_parameters(FakeRequest(parameters={"priority": 1, "timeout": 5, "seed": 3})) == {"seed": 3}


def test_scheduling_policy_is_an_engine_setting_with_two_values():
    def policy(value: str) -> dict:
        return engine_arguments({"scheduling_policy": {"string_value": value}})[1]

    assert policy("priority") == {"scheduling_policy": "priority"}
    assert policy("") == {}  # empty keeps the engine default, fcfs
    with pytest.raises(ValueError, match="scheduling_policy.*'lifo'.*fcfs, priority"):
        policy("lifo")
