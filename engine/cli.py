"""`pdcluster generate`: run the reference engine on one prompt (the numerical oracle of the cluster).

    pdcluster generate --model kimi-k3.1-mini (--prompt TEXT | --prompt-ids JSON) --max-tokens N [--seed S] [--temperature T]
                       [--top-p P] [--stop STR ...] [--weights FILE.safetensors] [--json]
                       [--device cpu|cuda] [--kernels reference|fast]

Weights are a random init from a fixed default seed (`--weights-seed`), so every process of a cluster and this
oracle share identical weights without files (built on the CPU, then moved to `--device`); `--weights` loads a
safetensors file over them. `--prompt-ids '[256, 72, 105]'` gives the prompt as token ids, used as they are (no
BOS added): any request a node served (a session turn included, whose ids the node's /tokenize or the
response's prompt_token_ids show) can be checked against this oracle. Greedy unless a temperature is given; `--seed` seeds sampling. Prints the text, token ids
and timings (`--json`: one object with text, token_ids, prompt_token_ids, logprobs, finish_reason and timings).
Bad input exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster generate", description="Generate with the reference engine.")
    p.add_argument("--model", default="kimi-k3.1-mini", help="model: a preset (default kimi-k3.1-mini), a ModelConfig .json file, or a checkpoint directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (byte-level tokens, BOS first)")
    source.add_argument("--prompt-ids", help="the prompt as a JSON list of token ids, used as they are")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--weights", default=None, help="safetensors file to load over the random init")
    p.add_argument("--weights-seed", type=int, default=None, help="random-init seed (default: the engine's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: weights, row pool and every "
                   "intermediate on that device (the oracle of nodes started with --device cuda)")
    p.add_argument("--kernels", default="reference", choices=["reference", "fast"],
                   help="reference (default; fp32) or fast (Triton, bf16; CUDA, or CPU under TRITON_INTERPRET=1); "
                   "what each runs: the kernel table of docs/ARCHITECTURE.md (engine/kernels.py)")
    return p


def _fail(message: str) -> int:
    print(f"pdcluster generate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from engine.model.config import resolve_model
    from engine.model.tokenizer import load_tokenizer

    try:
        cfg = resolve_model(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    if args.prompt_ids is not None:
        try:
            prompt_ids = _parse_ids(args.prompt_ids, cfg.vocab_size)
        except ValueError as exc:
            return _fail(str(exc))
    elif not args.prompt:
        return _fail("--prompt is empty")
    else:
        try:  # the model's own tokenizer: a checkpoint's files, else the presets' byte tokenizer (with BOS)
            prompt_ids = load_tokenizer(cfg.checkpoint or args.model).encode(args.prompt)
        except ValueError as exc:
            return _fail(str(exc))
    if args.max_tokens <= 0:
        return _fail(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        return _fail(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.model != "kimi-k3.1-mini" and cfg.d_model > 1024:
        return _fail(f"preset {args.model!r} is for layout and capacity math only; it is never instantiated")
    if len(prompt_ids) + args.max_tokens > cfg.max_context:
        return _fail(f"the model's maximum context length is {cfg.max_context} tokens; the request needs "
                     f"{len(prompt_ids) + args.max_tokens} ({len(prompt_ids)} prompt + {args.max_tokens} completion)")
    return _generate(args, prompt_ids)


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids: a non-empty JSON list of integer token ids in 0..vocab_size-1."""
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompt-ids is not JSON: {exc}") from exc
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("--prompt-ids must be a non-empty JSON list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids: token ids out of range 0..{vocab_size - 1}: {bad[:5]}")
    return ids


def _generate(args: argparse.Namespace, prompt_ids: list[int]) -> int:
    import torch

    from engine.api import DEFAULT_SEED, EngineConfig, SamplingParams
    from engine.engine import Engine

    torch.set_num_threads(1)
    started = time.perf_counter()
    seed = DEFAULT_SEED if args.weights_seed is None else args.weights_seed
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            return _fail(f"--device {args.device}: no CUDA device is visible")
        engine = Engine(EngineConfig(model=args.model, seed=seed, weights=args.weights, device=args.device,
                                     kernels=args.kernels,
                                     num_rows=_rows_needed(args.model, len(prompt_ids) + args.max_tokens)))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        engine.add_request("generate-0", prompt_ids, params)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    loaded = time.perf_counter()
    tokens, logprobs, finish, first_at = [], [], None, None
    while engine.has_work:
        for out in engine.step().tokens:
            tokens.append(out.token_id)
            logprobs.append(out.logprob)
            finish = out.finish_reason or finish
        first_at = first_at or time.perf_counter()
    done = time.perf_counter()
    text = engine.tokenizer.decode(tokens) if engine.tokenizer is not None else None  # weights-only checkpoint
    for stop in args.stop:
        if stop and stop in text:
            text = text[: text.index(stop)]
    timings = {
        "load_s": round(loaded - started, 4),
        "ttft_s": round((first_at or done) - loaded, 4),
        "decode_s": round(done - (first_at or done), 4),
        "tpot_s": round((done - (first_at or done)) / max(len(tokens) - 1, 1), 5),
        "total_s": round(done - started, 4),
    }
    result = {"model": args.model, "text": text, "token_ids": tokens, "prompt_token_ids": prompt_ids,
              "logprobs": logprobs, "finish_reason": finish, "timings": timings}
    if args.json:
        print(json.dumps(result))
    else:
        print(text)
        print(f"\nprompt_token_ids ({len(prompt_ids)}): {prompt_ids}")
        print(f"token_ids ({len(tokens)}): {tokens}")
        print(f"finish_reason: {finish}")
        print("timings: " + ", ".join(f"{k}={v}" for k, v in timings.items()))
    return 0


def _rows_needed(model: str, num_tokens: int) -> int:
    from engine.layout import plan_layout
    from engine.model.config import resolve_model

    num_attn, num_kda = plan_layout(resolve_model(model)).rows_per_request(num_tokens)
    return num_attn + num_kda
