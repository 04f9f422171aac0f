#!/usr/bin/env bash
# Third-party LLM clients, unchanged, against `pagedserve serve` (not in CI; docs/clients.md).
#
#   bash bench/clients.sh              genai-perf 0.0.16 on the llm model (KServe gRPC --backend vllm, and
#                                      HTTP generate_stream), on the ensemble (--backend tensorrtllm) and on
#                                      the OpenAI shim (chat, completions), then perf_analyzer on llm
#   bash bench/clients.sh --all        also aiperf 0.13 on the shim and lm-evaluation-harness 0.4.13
#                                      (local-completions on a local YAML task over a local JSON file)
#   bash bench/clients.sh --hf-parity  --all, and lm-eval's hf backend on the same model folder to compare
#
# Options: --requests N (16), --concurrency N (2), --input-tokens N (64), --output-tokens N (32),
# --out FILE (bench/results/clients.json). Each client has its own venv under $PAGEDSERVE_CACHE
# (~/.cache/pagedserve): clients-venv (genai-perf + perf_analyzer), aiperf-venv, lm-eval-venv; one
# that is there is reused. perf_analyzer is the binary of the tritonclient 2.60 wheel (`pip install
# perf-analyzer` is a placeholder); it needs glibc 2.38 and GLIBCXX_3.4.32, and where the system's are
# older (Debian 12: 2.36) the script fetches Debian trixie's libc6, libstdc++6 and libgcc-s1 with a
# scratch apt setup into $PAGEDSERVE_CACHE/glibc-trixie (nothing is installed on the system) and runs
# the binary through their loader from a `perf_analyzer` wrapper in clients-venv/bin. Nothing reaches
# the Hugging Face Hub (HF_HUB_OFFLINE=1; the model folder is the tokenizer). One server is started on
# free loopback ports and stopped at the end. Prints a table and writes every figure as JSON.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}"
PY="${PYTHON:-python3}"
PAGEDSERVE="${PAGEDSERVE:-$REPO/.venv/bin/pagedserve}"
CLIENTS_VENV="$CACHE/clients-venv"
AIPERF_VENV="$CACHE/aiperf-venv"
LMEVAL_VENV="$CACHE/lm-eval-venv"
GLIBC_ROOT="$CACHE/glibc-trixie"
GENAI_PERF_VERSION=0.0.16
TRITONCLIENT_VERSION=2.60.0
AIPERF_VERSION=0.13.0
LMEVAL_VERSION=0.4.13

REQUESTS=16
CONCURRENCY=2
INPUT_TOKENS=64
OUTPUT_TOKENS=32
OUT_JSON="$REPO/bench/results/clients.json"
ALL=0
HF_PARITY=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --requests) REQUESTS="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --input-tokens) INPUT_TOKENS="$2"; shift 2 ;;
        --output-tokens) OUTPUT_TOKENS="$2"; shift 2 ;;
        --out) OUT_JSON="$2"; shift 2 ;;
        --all) ALL=1; shift ;;
        --hf-parity) ALL=1; HF_PARITY=1; shift ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export COLUMNS="${COLUMNS:-160}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagedserve-clients.XXXXXX")"
RUNS="$WORK/runs.jsonl"
: >"$RUNS"
log() { echo "[clients] $*" >&2; }

# ---------------------------------------------------------------- installs

pip_install() {  # venv, pip arguments...
    local venv="$1"; shift
    [[ -x "$venv/bin/python" ]] || "$PY" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" >&2
    return "${PIPESTATUS[0]}"
}

ensure_genai_perf() {
    if [[ "$("$CLIENTS_VENV/bin/genai-perf" --version 2>/dev/null)" == *"$GENAI_PERF_VERSION"* &&
          -x "$CLIENTS_VENV/libexec/perf_analyzer" ]]; then
        return 0
    fi
    log "installing genai-perf $GENAI_PERF_VERSION and tritonclient $TRITONCLIENT_VERSION (perf_analyzer) into $CLIENTS_VENV"
    # `pip install perf-analyzer` is a 0.1.0 placeholder; the real binary ships in the tritonclient wheel.
    pip_install "$CLIENTS_VENV" "genai-perf==$GENAI_PERF_VERSION" "tritonclient==$TRITONCLIENT_VERSION" || return 1
    mkdir -p "$CLIENTS_VENV/libexec"
    # The wheel puts the ELF binary in bin/; it moves to libexec/ and bin/ gets the wrapper below.
    if [[ "$(head -c 4 "$CLIENTS_VENV/bin/perf_analyzer" 2>/dev/null)" == $'\x7fELF' ]]; then
        mv "$CLIENTS_VENV/bin/perf_analyzer" "$CLIENTS_VENV/libexec/perf_analyzer"
    fi
    [[ -x "$CLIENTS_VENV/libexec/perf_analyzer" ]]
}

glibc_instructions() {
    cat >&2 <<EOF
perf_analyzer ($CLIENTS_VENV/libexec/perf_analyzer) needs a newer glibc/libstdc++ than this system's:
$1
Do by hand what this script does on Debian/Ubuntu (x86_64): download Debian trixie's libc6, libstdc++6
and libgcc-s1 .debs (e.g. from https://packages.debian.org/trixie/), then
    for f in *.deb; do dpkg-deb -x "\$f" $GLIBC_ROOT; done      # or: ar x + tar xf data.tar.xz
and rerun this script: it finds $GLIBC_ROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 and writes the
wrapper $CLIENTS_VENV/bin/perf_analyzer. Or install perf_analyzer another way (NGC's tritonserver
-sdk container) and put it first on PATH.
EOF
}

fetch_trixie_libs() {  # Debian trixie's loader, libc and libstdc++ into $GLIBC_ROOT, with a scratch apt
    local apt="$WORK/apt"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
    : >"$apt/status"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
        >"$apt/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
                -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Dir::State::status=$apt/status"
                -o APT::Architecture=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
    log "fetching Debian trixie's libc6, libstdc++6, libgcc-s1 (scratch apt lists under $apt)"
    apt-get "${opts[@]}" -qq update >&2 || return 1
    (cd "$apt/debs" && apt-get "${opts[@]}" -qq download libc6 libstdc++6 libgcc-s1) >&2 || return 1
    mkdir -p "$GLIBC_ROOT"
    local deb
    for deb in "$apt/debs"/*.deb; do dpkg-deb -x "$deb" "$GLIBC_ROOT" || return 1; done
    rm -rf "$apt"
}

ensure_perf_analyzer() {
    local bin="$CLIENTS_VENV/libexec/perf_analyzer" wrapper="$CLIENTS_VENV/bin/perf_analyzer" err
    local loader="$GLIBC_ROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    if err="$("$bin" --version 2>&1)"; then
        printf '#!/bin/sh\nexec "%s" "$@"\n' "$bin" >"$wrapper"
        PA_GLIBC_WORKAROUND=false
    else
        if [[ "$err" != *GLIBC* ]]; then
            log "perf_analyzer does not run: $err"; return 1
        fi
        if [[ ! -x "$loader" ]]; then
            if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null || [[ "$(uname -m)" != x86_64 ]] ||
               ! fetch_trixie_libs; then
                glibc_instructions "$err"; return 1
            fi
        fi
        local libs="${loader%/*}"
        printf '#!/bin/sh\n# perf_analyzer needs glibc >= 2.38: run it on Debian trixie'"'"'s loader and libc (bench/clients.sh)\nexec "%s" --library-path "%s:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" "%s" "$@"\n' \
            "$loader" "$libs" "$bin" >"$wrapper"
        PA_GLIBC_WORKAROUND=true
    fi
    chmod +x "$wrapper"
    PA_VERSION="$("$wrapper" --version 2>&1)" || { log "the perf_analyzer wrapper fails: $PA_VERSION"; return 1; }
    log "$PA_VERSION (glibc workaround: $PA_GLIBC_WORKAROUND)"
}

ensure_aiperf() {
    [[ "$("$AIPERF_VENV/bin/aiperf" --version 2>/dev/null | tail -1)" == *"$AIPERF_VERSION"* ]] && return 0
    log "installing aiperf $AIPERF_VERSION into $AIPERF_VENV"
    pip_install "$AIPERF_VENV" "aiperf==$AIPERF_VERSION"
}

ensure_lm_eval() {
    local want=("lm_eval[api]==$LMEVAL_VERSION" transformers)
    # The hf backend needs torch: the CPU build (a bare `torch` would pull a multi-GB CUDA build).
    [[ $HF_PARITY == 1 ]] && want=("lm_eval[api,hf]==$LMEVAL_VERSION" transformers "${TORCH_SPEC:-torch==2.13.0}")
    if "$LMEVAL_VENV/bin/python" -c "
import importlib.metadata as m, sys
assert m.version('lm_eval') == '$LMEVAL_VERSION'; import transformers
if $HF_PARITY: import torch, accelerate" 2>/dev/null; then
        return 0
    fi
    log "installing lm-evaluation-harness $LMEVAL_VERSION into $LMEVAL_VENV"
    pip_install "$LMEVAL_VENV" "${want[@]}"
}

# ---------------------------------------------------------------- the server

free_ports() {  # N free loopback ports
    "$PY" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

SERVER_PID=""
stop_server() {
    [[ -n "$SERVER_PID" ]] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    local _
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

start_server() {
    read -r HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT < <(free_ports 4)
    log "starting pagedserve serve (HTTP $HTTP_PORT, gRPC $GRPC_PORT, metrics $METRICS_PORT, OpenAI $OPENAI_PORT); log: $WORK/serve.log"
    "$PAGEDSERVE" serve --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
        --openai-port "$OPENAI_PORT" >"$WORK/serve.log" 2>&1 &
    SERVER_PID=$!
    local _
    for _ in $(seq 600); do
        grep -q "Ctrl-C stops it" "$WORK/serve.log" && break
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$WORK/serve.log" >&2; log "pagedserve serve exited"; return 1; }
        sleep 0.5
    done
    MODEL_PATH="$(sed -n 's/^pagedserve is serving //p' "$WORK/serve.log" | head -1)"
    [[ -d "$MODEL_PATH" ]] || { tail -20 "$WORK/serve.log" >&2; log "the server did not come up"; return 1; }
    SHIM_MODEL="$(basename "$MODEL_PATH")"
    log "serving $MODEL_PATH"
}

# ---------------------------------------------------------------- runs

record() {  # name tool target rc wall_s artifact_dir command_file
    "$PY" - "$@" >>"$RUNS" <<'EOF'
import json, sys
name, tool, target, rc, wall, artifacts, cmd = sys.argv[1:]
print(json.dumps({"name": name, "tool": tool, "target": target, "rc": int(rc), "wall_s": float(wall),
                  "artifacts": artifacts, "command": open(cmd).read().strip()}))
EOF
}

run_client() {  # name tool target command...: runs it in its artifact folder, logs, records
    local name="$1" tool="$2" target="$3"; shift 3
    local dir="$WORK/$name"
    mkdir -p "$dir"
    local arg words=()
    for arg in "$@"; do
        arg="${arg#"$CLIENTS_VENV/bin/"}"; arg="${arg#"$AIPERF_VENV/bin/"}"; arg="${arg#"$LMEVAL_VENV/bin/"}"
        [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]] || arg="$(printf '%q' "$arg")"
        words+=("$arg")
    done
    echo "${words[*]}" >"$dir/command.txt"
    log "$name: $(cat "$dir/command.txt")"
    local start rc path="$PATH"
    # genai-perf runs `perf_analyzer` from PATH: the wrapper in clients-venv/bin.
    [[ $tool == genai-perf || $tool == perf_analyzer ]] && path="$CLIENTS_VENV/bin:$PATH"
    start=$(date +%s%N)
    (cd "$dir" && PATH="$path" timeout --kill-after=10 600 "$@") >"$dir/output.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
        log "$name FAILED (status $rc); the end of its output:"
        tail -15 "$dir/output.log" | sed 's/^/    /' >&2
    fi
    record "$name" "$tool" "$target" "$rc" "$(( ($(date +%s%N) - start) / 1000000 ))e-3" "$dir" "$dir/command.txt"
}

GENAI_COMMON=(--synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0
              --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 --random-seed 0
              --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count 2)

run_genai_perf() {
    local gp="$CLIENTS_VENV/bin/genai-perf" grpc="127.0.0.1:$GRPC_PORT" shim="http://127.0.0.1:$OPENAI_PORT"
    # --output-tokens-mean-deterministic: the vllm backend sends {"max_tokens": "N", "min_tokens": "N"}.
    run_client genai-perf-llm genai-perf "llm (KServe gRPC)" "$gp" profile -m llm --backend vllm \
        --endpoint-type kserve --streaming -u "$grpc" --tokenizer "$MODEL_PATH" \
        --output-tokens-mean-deterministic "${GENAI_COMMON[@]}" --artifact-dir "$WORK/genai-perf-llm/artifacts"
    # Triton's HTTP generate endpoint: a decoupled model streams from generate_stream only (genai-perf's
    # default path, generate, is refused: "generate expects model to produce exactly 1 response").
    run_client genai-perf-llm-http genai-perf "llm (HTTP generate_stream)" "$gp" profile -m llm \
        --endpoint-type generate --endpoint v2/models/llm/generate_stream --streaming -u "127.0.0.1:$HTTP_PORT" \
        --tokenizer "$MODEL_PATH" --extra-inputs "min_tokens:$OUTPUT_TOKENS" --extra-inputs ignore_eos:true \
        "${GENAI_COMMON[@]}" --artifact-dir "$WORK/genai-perf-llm-http/artifacts"
    # The tensorrtllm backend's deterministic flag sends TensorRT-LLM's old `min_length` tensor; pagedserve's
    # ensemble (like TensorRT-LLM's own today) names it `min_tokens`, so it goes as an extra input then.
    local fixed_length=(--extra-inputs "min_tokens:$OUTPUT_TOKENS")
    if curl -sf "http://127.0.0.1:$HTTP_PORT/v2/models/ensemble/config" | grep -q '"min_length"'; then
        fixed_length=(--output-tokens-mean-deterministic)
    fi
    run_client genai-perf-ensemble genai-perf "ensemble (KServe gRPC)" "$gp" profile -m ensemble \
        --backend tensorrtllm --endpoint-type kserve --streaming -u "$grpc" --tokenizer "$MODEL_PATH" \
        "${fixed_length[@]}" "${GENAI_COMMON[@]}" --artifact-dir "$WORK/genai-perf-ensemble/artifacts"
    local kind
    for kind in chat completions; do
        run_client "genai-perf-openai-$kind" genai-perf "OpenAI shim /v1/$kind" "$gp" profile -m "$SHIM_MODEL" \
            --endpoint-type "$kind" --streaming -u "$shim" --tokenizer "$MODEL_PATH" \
            --extra-inputs "min_tokens:$OUTPUT_TOKENS" --extra-inputs ignore_eos:true \
            "${GENAI_COMMON[@]}" --artifact-dir "$WORK/genai-perf-openai-$kind/artifacts"
    done
}

run_perf_analyzer() {  # on the llm model with its own input file: one prompt, fixed output length
    local data="$WORK/perf-analyzer-input.json"
    "$PY" - "$data" "$INPUT_TOKENS" "$OUTPUT_TOKENS" <<'EOF'
import json, sys
words = ("paged attention keeps keys and values in fixed blocks so that many requests share one pool "
         "while a scheduler admits them step by step").split()
prompts = [" ".join(words[(i + j) % len(words)] for j in range(int(sys.argv[2]) * 3 // 4)) for i in range(8)]
params = json.dumps({"max_tokens": int(sys.argv[3]), "min_tokens": int(sys.argv[3]), "temperature": 0})
json.dump({"data": [{"text_input": [p], "stream": [True], "exclude_input_in_output": [True],
                     "sampling_parameters": [params]} for p in prompts]}, open(sys.argv[1], "w"), indent=1)
EOF
    run_client perf-analyzer-llm perf_analyzer "llm (KServe gRPC)" perf_analyzer -m llm -i grpc --streaming \
        --async -u "127.0.0.1:$GRPC_PORT" --concurrency-range "$CONCURRENCY" --request-count "$REQUESTS" \
        --input-data "$data" --percentile 99 -f "$WORK/perf-analyzer-llm/summary.csv" \
        --profile-export-file "$WORK/perf-analyzer-llm/profile_export.json"
}

run_aiperf() {
    # aiperf 0.13 looks a tokenizer up in the HF cache when offline, even for a local folder: a private
    # cache whose snapshot links to the model folder, under the Hub-style name, keeps it off the Hub.
    local hub="$WORK/hf-hub" repo="HuggingFaceTB/$SHIM_MODEL"
    local entry="$hub/models--${repo//\//--}"
    mkdir -p "$entry/snapshots" "$entry/refs"
    ln -sfn "$MODEL_PATH" "$entry/snapshots/local"
    printf local >"$entry/refs/main"
    local kind
    for kind in chat completions; do
        HF_HUB_CACHE="$hub" run_client "aiperf-openai-$kind" aiperf "OpenAI shim /v1/$kind" "$AIPERF_VENV/bin/aiperf" \
            profile -m "$SHIM_MODEL" --endpoint-type "$kind" --streaming -u "http://127.0.0.1:$OPENAI_PORT" \
            --tokenizer "$repo" --extra-inputs "min_tokens:$OUTPUT_TOKENS" --extra-inputs ignore_eos:true \
            "${GENAI_COMMON[@]}" --artifact-dir "$WORK/aiperf-openai-$kind/artifacts"
    done
}

write_lm_eval_task() {  # a 16-question task, multiple-choice (loglikelihood) and generate_until, local files
    local tasks="$WORK/lm-eval-tasks"
    mkdir -p "$tasks"
    "$PY" - "$tasks/capitals.jsonl" <<'EOF'
import json, sys
rows = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
        ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"),
        ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"), ("Poland", "Warsaw"),
        ("Ireland", "Dublin"), ("Kenya", "Nairobi")]
capitals = [c for _, c in rows]
with open(sys.argv[1], "w") as f:
    for i, (country, capital) in enumerate(rows):
        choices = [capital] + [capitals[(i + k) % len(capitals)] for k in (3, 7, 11)]
        choices = choices[-(i % 4):] + choices[:-(i % 4)] if i % 4 else choices
        f.write(json.dumps({"country": country, "capital": capital, "choices": choices,
                            "answer": choices.index(capital)}) + "\n")
EOF
    cat >"$tasks/capitals_mc.yaml" <<EOF
task: pagedserve_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: $tasks/capitals.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{country}}?\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
EOF
    cat >"$tasks/capitals_gen.yaml" <<EOF
task: pagedserve_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: $tasks/capitals.jsonl
test_split: test
output_type: generate_until
doc_to_text: "The capital of France is Paris.\nThe capital of {{country}} is"
doc_to_target: " {{capital}}"
generation_kwargs:
  until: [".", "\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ['\s+']
EOF
    LMEVAL_TASKS="$tasks"
}

run_lm_eval() {
    write_lm_eval_task
    local lm="$LMEVAL_VENV/bin/lm_eval" tasks=pagedserve_capitals_mc,pagedserve_capitals_gen tokenized
    local url="http://127.0.0.1:$OPENAI_PORT/v1/completions"
    for tokenized in False True; do
        local name="lm-eval-local-completions"
        [[ $tokenized == True ]] && name="$name-tokenized"
        run_client "$name" lm-eval "OpenAI shim /v1/completions" "$lm" --model local-completions \
            --model_args "model=$SHIM_MODEL,base_url=$url,tokenizer=$MODEL_PATH,tokenizer_backend=huggingface,tokenized_requests=$tokenized,num_concurrent=1,max_retries=1" \
            --include_path "$LMEVAL_TASKS" --tasks "$tasks" --device cpu --output_path "$WORK/$name/results" --log_samples
    done
    if [[ $HF_PARITY == 1 ]]; then
        run_client lm-eval-hf lm-eval "transformers on the same folder (no server)" "$lm" --model hf \
            --model_args "pretrained=$MODEL_PATH,dtype=float32" --include_path "$LMEVAL_TASKS" --tasks "$tasks" \
            --device cpu --batch_size 4 --output_path "$WORK/lm-eval-hf/results" --log_samples
    fi
}

# ---------------------------------------------------------------- summary

summarize() {
    REPO="$REPO" MODEL_PATH="$MODEL_PATH" INPUT_TOKENS="$INPUT_TOKENS" OUTPUT_TOKENS="$OUTPUT_TOKENS" \
    CONCURRENCY="$CONCURRENCY" REQUESTS="$REQUESTS" ALL="$ALL" PA_GLIBC_WORKAROUND="$PA_GLIBC_WORKAROUND" \
    CLIENTS_VENV="$CLIENTS_VENV" AIPERF_VENV="$AIPERF_VENV" LMEVAL_VENV="$LMEVAL_VENV" \
        "$PY" - "$RUNS" "$OUT_JSON" "$WORK" <<'EOF'
import csv, glob, json, os, platform, subprocess, sys, time
from pathlib import Path

runs_file, out_json, work = sys.argv[1:]
env = os.environ
runs = [json.loads(line) for line in open(runs_file)]


def stats(block, keys=("avg", "p50", "p90", "p99")):
    return {k: round(block[k], 3) for k in keys if block.get(k) is not None} if block else None


def llm_metrics(path):
    """genai-perf's and aiperf's summary JSON share these names."""
    d = json.load(open(path))
    m = {"ttft_ms": stats(d.get("time_to_first_token")), "itl_ms": stats(d.get("inter_token_latency")),
         "request_latency_ms": stats(d.get("request_latency")),
         "output_token_throughput_tok_s": round(d["output_token_throughput"]["avg"], 3),
         "request_throughput_req_s": round(d["request_throughput"]["avg"], 4),
         "output_sequence_length": stats(d.get("output_sequence_length"), ("avg", "min", "max")),
         "input_sequence_length_avg": d.get("input_sequence_length", {}).get("avg"),
         "request_count": int(d["request_count"]["avg"])}
    if "usage_completion_tokens" in d:
        m["server_completion_tokens_avg"] = d["usage_completion_tokens"]["avg"]
    if d.get("error_summary"):
        m["errors"] = d["error_summary"]
    return m


def perf_analyzer_metrics(path):
    row = next(csv.DictReader(open(path)))
    return {"throughput_infer_s": float(row["Inferences/Second"]),
            "response_throughput_s": float(row["Response Throughput"]),
            "latency_ms": {k.split()[0]: int(row[k]) / 1e3 for k in ("p50 latency", "p90 latency", "p99 latency")}}


def lm_eval_metrics(folder):
    files = sorted(glob.glob(f"{folder}/**/results_*.json", recursive=True))
    res = json.load(open(files[-1]))["results"]
    return {task: {k.split(",")[0]: round(v, 4) for k, v in r.items() if k.endswith(",none")}
            for task, r in res.items()}


artifacts = {}
for r in runs:
    art = artifacts[r["name"]] = Path(r.pop("artifacts"))
    try:
        if r["rc"] != 0:
            raise RuntimeError(f"exit status {r['rc']}")
        if r["tool"] == "genai-perf":
            r["metrics"] = llm_metrics(next(art.glob("artifacts/*/profile_export_genai_perf.json")))
        elif r["tool"] == "aiperf":
            r["metrics"] = llm_metrics(art / "artifacts/profile_export_aiperf.json")
        elif r["tool"] == "perf_analyzer":
            r["metrics"] = perf_analyzer_metrics(art / "summary.csv")
        else:
            r["metrics"] = lm_eval_metrics(art / "results")
        r["ok"] = True
    except Exception as e:  # a failed run keeps its status and the end of its output
        r["ok"] = False
        r["error"] = f"{type(e).__name__}: {e}"
        out = art / "output.log"
        r["output_tail"] = out.read_text(errors="replace").splitlines()[-15:] if out.exists() else []


def lm_eval_samples(name, task):
    files = sorted(artifacts[name].glob(f"results/**/samples_{task}_*.jsonl"))
    return {d["doc_id"]: d["filtered_resps"] for d in map(json.loads, open(files[-1]))}


def lm_eval_parity(served, reference):
    """Per-sample agreement of two lm-eval runs: loglikelihood of every choice, and generated text."""
    mc = [lm_eval_samples(n, "pagedserve_capitals_mc") for n in (served, reference)]
    deltas = [abs(float(a[0]) - float(b[0])) for doc in mc[1] for a, b in zip(mc[0][doc], mc[1][doc])]
    gen = [lm_eval_samples(n, "pagedserve_capitals_gen") for n in (served, reference)]
    return {"runs": [served, reference], "choices": len(deltas), "max_abs_loglikelihood_diff": max(deltas),
            "generations": len(gen[1]), "identical_generations": sum(gen[0][d] == gen[1][d] for d in gen[1])}


def version(cmd):
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        return done.stdout.strip().splitlines()[-1]
    except Exception:
        return None


def git(*args):
    return subprocess.run(["git", "-C", env["REPO"], *args], capture_output=True, text=True).stdout


workload = {k.lower(): int(env[k]) for k in ("INPUT_TOKENS", "OUTPUT_TOKENS", "CONCURRENCY", "REQUESTS")}
clients = {"genai-perf": version([f"{env['CLIENTS_VENV']}/bin/genai-perf", "--version"]),
           "perf_analyzer": version([f"{env['CLIENTS_VENV']}/bin/perf_analyzer", "--version"]),
           "perf_analyzer_glibc_workaround": env["PA_GLIBC_WORKAROUND"] == "true"}
if env["ALL"] == "1":
    clients["aiperf"] = version([f"{env['AIPERF_VENV']}/bin/aiperf", "--version"])
    clients["lm_eval"] = version([f"{env['LMEVAL_VENV']}/bin/python", "-c",
                                  "import importlib.metadata as m; print(m.version('lm_eval'))"])
modified = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
result = {
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "glibc": platform.libc_ver()[1],
                "load_average_1_5_15_after": [round(x, 2) for x in os.getloadavg()]},
    "pagedserve": {"commit": git("rev-parse", "--short", "HEAD").strip(), "modified_files": modified},
    "model": Path(env["MODEL_PATH"]).name,
    "workload": {**workload, "warmup_requests": 2},
    "clients": clients,
    "runs": runs,
}
ok = {r["name"] for r in runs if r["ok"]}
result["lm_eval_parity"] = [lm_eval_parity(n, "lm-eval-hf") for n in sorted(ok)
                            if n.startswith("lm-eval-local") and "lm-eval-hf" in ok]
Path(out_json).parent.mkdir(parents=True, exist_ok=True)
Path(out_json).write_text(json.dumps(result, indent=2) + "\n")


def cell(block, key):
    return f"{block[key]:.1f}" if block and block.get(key) is not None else "-"


print(f"\n{result['model']}: {workload['input_tokens']} input / {workload['output_tokens']} output tokens, "
      f"concurrency {workload['concurrency']}, {workload['requests']} requests; times in ms")
head = (f"{'run':<34} {'TTFT avg':>9} {'p50':>7} {'p99':>7} {'ITL avg':>8} {'p99':>7} {'out tok/s':>9} "
        f"{'req/s':>6} {'OSL':>5}")
print(head)
print("-" * len(head))
for r in runs:
    m = r.get("metrics") or {}
    if not r["ok"]:
        print(f"{r['name']:<34} FAILED ({r['error']})")
    elif r["tool"] in ("genai-perf", "aiperf"):
        osl = m["output_sequence_length"]["avg"]
        print(f"{r['name']:<34} {cell(m['ttft_ms'], 'avg'):>9} {cell(m['ttft_ms'], 'p50'):>7} "
              f"{cell(m['ttft_ms'], 'p99'):>7} {cell(m['itl_ms'], 'avg'):>8} {cell(m['itl_ms'], 'p99'):>7} "
              f"{m['output_token_throughput_tok_s']:>9.1f} {m['request_throughput_req_s']:>6.2f} {osl:>5.1f}")
    elif r["tool"] == "perf_analyzer":
        lat = m["latency_ms"]
        print(f"{r['name']:<34} {m['throughput_infer_s']:.3f} req/s, {m['response_throughput_s']:.1f} responses/s, "
              f"request latency p50 {lat['p50']:.0f}, p99 {lat['p99']:.0f}")
    else:
        print(f"{r['name']:<34} " + "; ".join(
            f"{task} " + " ".join(f"{k} {v}" for k, v in s.items()) for task, s in sorted(m.items())))
for par in result["lm_eval_parity"]:
    print(f"{par['runs'][0]} vs {par['runs'][1]}: {par['choices']} choice loglikelihoods within "
          f"{par['max_abs_loglikelihood_diff']:.1e}, {par['identical_generations']}/{par['generations']} generations identical")
print(f"\nwrote {out_json}; artifacts and logs: {work}")
sys.exit(0 if all(r["ok"] for r in runs) else 1)
EOF
}

# ---------------------------------------------------------------- main

[[ -x "$PAGEDSERVE" ]] || { log "$PAGEDSERVE not found: run 'make install' first"; exit 1; }
PA_GLIBC_WORKAROUND=false
ensure_genai_perf || { log "genai-perf install failed"; exit 1; }
PA_OK=1
ensure_perf_analyzer || PA_OK=0
if [[ $ALL == 1 ]]; then
    ensure_aiperf || { log "aiperf install failed"; ALL_AIPERF=0; }
    ensure_lm_eval || { log "lm-eval install failed"; ALL_LMEVAL=0; }
fi
start_server || exit 1
if [[ $PA_OK == 1 ]]; then
    run_genai_perf
    run_perf_analyzer
else
    log "skipping genai-perf and perf_analyzer: no working perf_analyzer (see above)"
fi
if [[ $ALL == 1 ]]; then
    [[ ${ALL_AIPERF:-1} == 1 ]] && run_aiperf
    [[ ${ALL_LMEVAL:-1} == 1 ]] && run_lm_eval
fi
stop_server
summarize
