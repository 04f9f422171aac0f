"""Multi-LoRA kernel timings on the CPU: the grouped path (one matmul per adapter present) against the
gather-bmm form (every row gathers its adapter's weights), shrink + expand of one projection.

`python bench/lora_kernels.py` writes bench/results/lora_kernels_cpu.json; one thread by default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from kernel_timing import REPO, bench_ms, log


def _case(tokens: int, k: int, n: int, rank: int, adapters: int, base_share: float, contiguous: bool,
          dtype: torch.dtype):
    gen = torch.Generator().manual_seed(tokens + rank)
    slots = torch.randint(0, adapters, (tokens,), generator=gen)
    slots[torch.rand(tokens, generator=gen) < base_share] = -1
    if contiguous:  # prefill-like: each request's rows together
        slots = slots.sort().values
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = (torch.randn(adapters, rank, k, generator=gen) / k ** 0.5).to(dtype)
    b = (torch.randn(adapters, n, rank, generator=gen) / rank ** 0.5).to(dtype)
    return x, a, b, slots, torch.zeros(tokens, n, dtype=dtype)


def _time_paths(x, a, b, slots, out, rep: int) -> dict:
    """Milliseconds of shrink + expand by the reference, the grouped path, and the grouped path given groups."""
    from pagedserve.kernels.lora import cpu, reference
    from pagedserve.kernels.lora.grouping import group_slots

    device, groups = torch.device("cpu"), group_slots(slots)

    def both(module, **kw) -> None:
        module.lora_expand_add(out, module.lora_shrink(x, a, slots, **kw), b, slots, **kw)

    return {"gather_bmm_ms": bench_ms(lambda: both(reference), device, rep=rep),
            "grouped_ms": bench_ms(lambda: both(cpu), device, rep=rep),
            "grouped_pregrouped_ms": bench_ms(lambda: both(cpu, groups=groups), device, rep=rep),
            "group_slots_ms": bench_ms(lambda: group_slots(slots), device, rep=rep)}


def run(args: argparse.Namespace) -> dict:
    """Shrink + expand per path over decode-like (mixed rows) and prefill-like (sorted rows) batches."""
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, contiguous in ((8, False), (32, False), (128, False), (512, True)):
            case = _case(tokens, args.k, args.n, args.rank, 4, 0.2, contiguous, dtype)
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "sorted_rows": contiguous,
                   **_time_paths(*case, rep=args.rep)}
            rows.append(row)
            log(json.dumps(row))
    return {"k": args.k, "n": args.n, "rank": args.rank, "adapters": 4, "base_share": 0.2,
            "threads": args.threads, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=576, help="input features (SmolLM2-135M hidden)")
    parser.add_argument("--n", type=int, default=1536, help="output features (SmolLM2-135M intermediate)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "lora_kernels_cpu.json"))
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(run(args), indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
