"""What the tests share, imported as `tests.support.<module>`: `servers` starts tritonserver and wraps it in
`RunningTriton`, `inputs` builds every Triton request, `streams` is the one gRPC stream client, `oracle` the
transformers reference and `engines` the in-process engine the tests build."""
