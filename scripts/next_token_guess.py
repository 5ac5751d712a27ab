"""How well the next token's first MoE layers can be guessed at the end of a decode step, on the
CPU (no GPU): the question behind round AN's next step (docs/perf.md), where layer 0's experts
are all misses because no router inside the step can guess them.

    python scripts/next_token_guess.py --model DIR [--tokens 64] [--layers 3] [--seed 0]

Greedy decode of one random prompt with the resident strategy, recording each step's routed
experts per MoE layer. The guess for step t+1's layer L: the router of L applied to the RMSNorm
(layer 0's post-attention norm) of the embedding of step t's argmax token, i.e. what the step's
graph could compute after its logits. One JSON line per layer: of the experts step t+1 routes to
that step t did not use (those most likely to miss in the cache), the share the guess names
(`new_named`), the same for the last token's other experts as a guess (a baseline that names
nothing new), the guess's precision against all of step t+1's experts, and the counts.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from ft.engine.config import EngineConfig
from ft.engine.model.decoder import route
from ft.engine.runner import LLMEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = EngineConfig(
        model=args.model, device="cpu", dtype="bfloat16", moe_strategy="resident",
        max_model_len=args.tokens + 40,
    )  # fmt: skip
    engine = LLMEngine(config)
    model, strategy, cfg = engine.model, engine.strategy, engine.model.cfg
    routed: list[dict[int, set[int]]] = []  # per decode step: layer -> experts
    argmax: list[int] = []
    forward, logits = strategy.forward, model.logits

    def recording_forward(layer, x, topk_ids, topk_weights):
        if x.shape[0] == 1:  # decode: one token
            if layer == 0:
                routed.append({})
            routed[-1][layer] = set(topk_ids.flatten().tolist())
        return forward(layer, x, topk_ids, topk_weights)

    def recording_logits(h, delta):
        out = logits(h, delta)
        argmax.append(int(out[-1].argmax()))
        return out

    strategy.forward, model.logits = recording_forward, recording_logits
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (32,), generator=gen).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # argmax[0] is the prefill's token, the input of decode step 0; argmax[t + 1] of step t + 1
    moe = [layer for layer in model.layers if layer.is_moe][: args.layers]
    norm = moe[0].w["ln2"]
    for layer in moe:
        new = named = prev_precise = guessed_right = guessed = 0
        for t in range(len(routed) - 1):
            nxt_token = argmax[t + 1]  # what step t's logits pick: step t + 1's input
            e = F.embedding(torch.tensor([nxt_token]), model.embed).float()
            x = F.rms_norm(e, (e.shape[-1],), norm.float(), cfg.rms_norm_eps)
            ids, _ = route(cfg, layer.w["router"].float(), x)
            guess = set(ids.flatten().tolist())
            now, before = routed[t + 1][layer.index], routed[t][layer.index]
            fresh = now - before
            new += len(fresh)
            named += len(fresh & guess)
            guessed += len(guess)
            guessed_right += len(guess & now)
            prev_precise += len(now & before)
        steps = len(routed) - 1
        print(json.dumps({
            "layer": layer.index, "steps": steps, "new_per_step": round(new / steps, 2),
            "new_named": round(named / max(new, 1), 3),
            "guess_precision": round(guessed_right / max(guessed, 1), 3),
            "reused_from_last_token": round(prev_precise / (steps * cfg.top_k), 3),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
