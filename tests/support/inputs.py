"""The one way tests build Triton requests, from plain values: the same dict serves gRPC and HTTP."""

from __future__ import annotations

import json

import numpy as np
import tritonclient.grpc as grpcclient

_TRITON_DTYPES = {
    np.object_: "BYTES", np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64",
    np.uint8: "UINT8",
}


def as_array(value: object) -> np.ndarray:
    """The tensor of one plain value: str/bytes -> BYTES[1], bool -> BOOL[1], list[str] -> BYTES[n],
    dict -> its JSON as BYTES[1], or a numpy array as is (int32, float32, uint64, bool, object)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, dict):
        return np.array([json.dumps(value).encode()], dtype=np.object_)
    if isinstance(value, (str, bytes)):
        return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    if isinstance(value, list):
        return np.array([v.encode() for v in value], dtype=np.object_)
    raise TypeError(f"no tensor form for {value!r}")


def grpc_inputs(values: dict[str, object]) -> list[grpcclient.InferInput]:
    """tritonclient gRPC inputs, one per name, each from `as_array`."""
    inputs = []
    for name, value in values.items():
        array = as_array(value)
        tensor = grpcclient.InferInput(name, list(array.shape), _TRITON_DTYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def http_body(values: dict[str, object] | bytes) -> bytes:
    """The JSON body of Triton's generate endpoint; a dict value (sampling_parameters) goes as its JSON text,
    as `grpc_inputs` sends it. Bytes are sent as they are (a body that is not JSON)."""
    if isinstance(values, bytes):
        return values
    body = {name: json.dumps(value) if isinstance(value, dict) else value for name, value in values.items()}
    return json.dumps(body).encode()
