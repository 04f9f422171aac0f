"""The Responses API's store: the oldest response is evicted when it is full, a response older than the age
bound is gone, and an unknown id is a 404 in OpenAI's shape naming the field; Messages' key check takes
x-api-key or a bearer token."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.responses_store import ResponseStore
from pagedserve.client.openai.serving_messages import _authorize


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _body(i: int) -> dict:
    return {"id": f"resp_{i}", "status": "completed"}


def test_full_store_evicts_the_oldest() -> None:
    store = ResponseStore(size=2, max_age_s=60, clock=Clock())
    for i in range(3):
        store.put(_body(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 2
    with pytest.raises(APIError) as info:
        store.get("resp_0", "previous_response_id")
    assert info.value.status == 404 and info.value.param == "previous_response_id"
    assert store.get("resp_2").history == [{"role": "user", "content": "2"}]


def test_old_responses_expire() -> None:
    clock = Clock()
    store = ResponseStore(size=8, max_age_s=10, clock=clock)
    store.put(_body(0), [])
    clock.now = 5
    store.put(_body(1), [])
    clock.now = 12
    with pytest.raises(APIError):
        store.get("resp_0")
    assert store.get("resp_1").body["id"] == "resp_1"
    store.delete("resp_1")
    assert len(store) == 0
    with pytest.raises(APIError):
        store.delete("resp_1")


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        ResponseStore(size=0)
    with pytest.raises(ValueError):
        ResponseStore(max_age_s=0)


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": raw})


def test_messages_key_from_x_api_key_or_bearer() -> None:
    _authorize(_request({"x-api-key": "k"}), "k")
    _authorize(_request({"authorization": "Bearer k"}), "k")
    _authorize(_request({}), None)
    for headers in ({"x-api-key": "nope"}, {}, {"authorization": "Basic k"}):
        with pytest.raises(APIError) as info:
            _authorize(_request(headers), "k")
        assert info.value.status == 401
