"""`ft generate`: one prompt through the engine, printed as text or one JSON object."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from ft.cli.options import EngineFlags, engine_options
from ft.errors import FtError


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


@engine_options(exclude=("max_num_seqs",))
def generate(
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_ids: Annotated[
        str | None, typer.Option("--prompt-ids", help="Prompt as token ids: 1,2,3.")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at EOS.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    engine: EngineFlags,
) -> None:
    """Generate from one prompt with the reference engine (greedy unless --temperature)."""
    from ft.engine.runner import LLMEngine, SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise FtError("give exactly one of --prompt or --prompt-ids")
    params = SamplingParams(max_tokens, temperature, top_p, seed, ignore_eos)
    llm = LLMEngine(engine.config(max_num_seqs=1))
    try:
        ids = _parse_ids(prompt_ids) if prompt_ids is not None else llm.tokenizer.encode(prompt)
        result = run_one(llm, ids, params)
    finally:
        llm.close()
    if json_out:
        typer.echo(json.dumps(result))
    else:
        _print_human(result)


def run_one(engine, prompt_ids: list[int], params) -> dict:
    """Drive the engine for one request; -> the `--json` object."""
    start = time.perf_counter()
    engine.add_request(prompt_ids, params)
    tokens, ttft, reason, after_prefill = [], None, None, None
    while engine.has_unfinished():
        for out in engine.step():
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens.append(out.token_id)
            reason = out.finish_reason
        after_prefill = after_prefill or engine.stats
    stats = engine.stats
    decode = {
        f"decode_{k}": getattr(stats, k) - getattr(after_prefill, k)
        for k in (
            "cache_hits",
            "cache_misses",
            "bytes_fetched",
            "experts_fetched",
            "experts_in_place",
            "experts_cpu",
        )  # fmt: skip
    }  # the steady state, without the prompt's cold misses
    return {
        "model": engine.model_name, "prompt_tokens": len(prompt_ids), "token_ids": tokens,
        "text": engine.tokenizer.decode(tokens), "finish_reason": reason,
        "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s, "ttft_s": ttft,
        "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses,
        "experts_fetched": stats.experts_fetched, "experts_in_place": stats.experts_in_place,
        "bytes_fetched": stats.bytes_fetched,
        "expert_uses": stats.expert_uses, "experts_cpu": stats.experts_cpu,
        "experts_cpu_inline": stats.experts_cpu_inline, "moe_strategy": engine.config.moe_strategy,
        "device": engine.config.device, "dtype": engine.config.dtype,
        "moe_cache_size": engine.moe_cache_size, "decode_tokens": stats.decode_tokens, **decode,
    }  # fmt: skip


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise FtError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _print_human(result: dict) -> None:
    typer.echo(result["text"])
    uses = result["expert_uses"] or 1
    typer.echo(
        f"\n{len(result['token_ids'])} tokens ({result['finish_reason']}); "
        f"prefill {result['prefill_tok_s']:.1f} tok/s, decode {result['decode_tok_s']:.1f} tok/s, "
        f"TTFT {result['ttft_s']:.3f} s; expert cache hit rate {result['cache_hits'] / uses:.1%}, "
        f"{result['bytes_fetched'] / 1e6:.1f} MB fetched",
        err=True,
    )
