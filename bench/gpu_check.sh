#!/usr/bin/env bash
# The GPU check: Triton kernels at real sizes on a CUDA machine (made for the H200 device machine).
#
#   bash bench/gpu_check.sh            on the GPU machine, from the repository root; results under $OUT
#   bash bench/gpu_check.sh --dry-run  anywhere: tiny sizes on the CPU under TRITON_INTERPRET=1
#   GPU_CHECK_PARTS="tp" bash bench/gpu_check.sh   only the named parts (default: all six)
#
# correctness covers every Triton kernel against its torch reference, the W8A16 / W4A16 quantized GEMM
# (pagedserve/kernels/quant_linear) included, decode and prefill rows, each also timed against bf16 F.linear. kv8
# (bench/gpu_kv8.py) checks the fp8 KV cache kernels (write bytes, attention on e4m3 / e5m2 caches) and times fp8
# against bf16 decode. tp runs
# bench/tp_gpu.py: one engine on one GPU against one split over two with NCCL (skipped with fewer than 2 GPUs;
# its dry run is two CPU ranks over gloo).
# Writes $OUT/gpu_check.json (every figure), $OUT/gpu_check.log (the run's output) and $OUT/env.log.
# $OUT defaults to bench/results/gpu_check (dry run: a temporary folder). Needs python3 with torch and
# triton; pagedserve need not be installed. Each part has its own time limit so the whole run ends
# within 9 minutes; a part that fails or runs out of time is recorded and the others still run.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=(--dry-run)
    export TRITON_INTERPRET=1
    # The dry run proves the engine wiring on the Triton kernels, not on the CPU reference.
    export PAGEDSERVE_KERNELS=triton
    OUT="${OUT:-$(mktemp -d)}"
elif [[ -n "${1:-}" ]]; then
    echo "usage: $0 [--dry-run]" >&2
    exit 2
fi
OUT="${OUT:-$REPO/bench/results/gpu_check}"
mkdir -p "$OUT"

# pagedserve maps its sub-packages onto top-level folders (pyproject package-dir); without an install,
# a folder of symlinks on PYTHONPATH gives the same import names.
if ! (cd / && "$PY" -c "import pagedserve.kernels.dispatch" 2>/dev/null); then
    SHIM="$(mktemp -d)"
    mkdir -p "$SHIM/pagedserve"
    cp "$REPO/pagedserve/__init__.py" "$SHIM/pagedserve/"
    for sub in backend kernels client; do
        ln -s "$REPO/$sub" "$SHIM/pagedserve/$sub"
    done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

status=0
PARTS=" ${GPU_CHECK_PARTS:-correctness decode prefill engine kv8 tp} "
# part name, time limit in seconds: the first five 540 s in all (590 s with every kill grace, inside the
# device's 10 minutes a call); tp is its own 150 s, so a machine with 2 GPUs runs it as a second call
# (GPU_CHECK_PARTS=tp) when the first would not fit.
for spec in correctness:170 decode:80 prefill:80 engine:110 kv8:100 tp:150; do
    part="${spec%%:*}"
    limit="${spec##*:}"
    [[ "$PARTS" == *" $part "* ]] || continue
    echo "=== $part (limit ${limit}s)"
    if [[ "$part" == tp ]]; then
        # The engine on its own kernels (CPU ones in the dry run: two interpreted ranks would not fit).
        env -u TRITON_INTERPRET PAGEDSERVE_KERNELS=auto timeout --kill-after=10 "$limit" "$PY" "$REPO/bench/tp_gpu.py" \
            "${DRY[@]}" --out "$OUT/$part" 2>&1 | tee "$OUT/$part.log"
    else
        timeout --kill-after=10 "$limit" "$PY" "$REPO/bench/kernel_bench.py" gpu-check "${DRY[@]}" \
            --out "$OUT/$part" --parts "$part" 2>&1 | tee "$OUT/$part.log"
    fi
    rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        echo "=== $part exited with status $rc" | tee -a "$OUT/$part.log"
        status=1
    fi
done

# One JSON for the whole check, merged from the parts.
"$PY" - "$OUT" $PARTS <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
merged = {}
for part in sys.argv[2:]:  # the parts this run ran
    f = out / part / ("tp_gpu.json" if part == "tp" else "gpu_check.json")
    merged[part] = json.loads(f.read_text()) if f.is_file() else {"error": "no result (failed or timed out)"}
(out / "gpu_check.json").write_text(json.dumps(merged, indent=2) + "\n")
logs = [(out / f"{p}.log").read_text() for p in merged if (out / f"{p}.log").is_file()]
(out / "gpu_check.log").write_text("\n".join(logs))
print(f"wrote {out / 'gpu_check.json'}")
EOF
exit $status
