"""The attention kernels compile for the H100/H200 (sm_90) without a GPU: no register spills, shared memory
within the limit. Catches what the interpreter cannot (tile sizes that do not fit the real chip)."""

from __future__ import annotations

from tests.support.kernel_checks import compile_for_sm90

# Runs in a fresh interpreter: here the kernels were decorated for TRITON_INTERPRET and cannot compile.
_SCRIPT = """
import json, torch
from pagedserve.kernels.attention import triton as attention_triton
from pagedserve.kernels.aot import compile_launch, record_launches

def batch(lens, hq=32, hkv=8, d=128, bs=16):
    blocks = sum(-(-k // bs) for _, k in lens)
    cache = torch.zeros(blocks, bs, hkv, d, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32)[None].expand(len(lens), -1).contiguous()
    q_lens = torch.tensor([q for q, _ in lens])
    cu = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int()
    query = torch.zeros(int(q_lens.sum()), hq, d, dtype=torch.bfloat16)
    return (query, cache, cache, tables, cu, torch.tensor([k for _, k in lens], dtype=torch.int32), 0.1,
            int(q_lens.max()), max(k for _, k in lens))

with record_launches(attention_triton) as launches:
    attention_triton.paged_attention(*batch([(1, 4096)] * 2))           # decode tile
    attention_triton.paged_attention(*batch([(512, 512), (1, 700)]))    # 128-row prefill tile
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


def test_decode_and_prefill_attention_compile_for_sm90_without_spills():
    configs = compile_for_sm90(_SCRIPT)
    assert [c["constexprs"]["BLOCK_M"] for c in configs] == [16, 128]
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90
