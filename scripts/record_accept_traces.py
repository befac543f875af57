"""Acceptance of a DDTree round at EVERY position of a greedy generation, for offline replay of
the adaptive budget controller (scripts/sim_adaptive.py). Runs on the CPU.

Per prompt: the engine generates `--tokens` greedy tokens with DDTREE (speculation leaves greedy
output equal to plain decoding) and keeps the drafter's context keys/values (the rows the engine
itself projected from the target's hidden states). Then, for every position p of the generation,
the round the engine would run there: DFlash drafts from the context rows before p with the token
at p as root, `build_tree` at the largest budget, and the walk follows the known greedy
continuation (the target's argmax along the true path IS the continuation; off the path the walk
never looks). A smaller budget's tree is the first B nodes of the larger one (spec/tree.py), so
the path cut at its first node index > B is that budget's walk: one tree per position gives every
budget. Checked against the engine: the positions where the fixed-budget run started its rounds
must give the accept lengths the engine measured there (`check` in the JSON).

    PYTHONPATH=src python scripts/record_accept_traces.py --json traces.json [--n 8 --tokens 128]
        [--skip 8]  (prompts 8.. : a second set, to check a tuning on traces it was not tuned on)
        [--texts code]  (the prose prompts repeat six paragraphs: a third set is code only)
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import DATA, PROSE, code_prompts, prose_prompts  # noqa: E402

from treeverify.bench.kernel import _git_commit  # noqa: E402
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.spec.tree import build_tree  # noqa: E402


def walk(tokens: list[int], parents: list[int], cont: list[int]) -> list[int]:
    """Node indices of the greedy walk (root first) when the target's continuation is `cont`."""
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents[1:], start=1):
        children.setdefault(par, []).append(i)
    path, node = [0], 0
    for tok in cont:
        nxt = [c for c in children.get(node, []) if tokens[c] == tok]
        if not nxt:
            break
        node = nxt[0]  # siblings carry distinct tokens
        path.append(node)
    return path


@torch.inference_mode()
def trace_prompt(llm: LLM, prompt: str, tokens: int, budget: int, chunk: int = 32,
                 keep: dict | None = None) -> dict:  # fmt: skip
    """The prompt's trace; `keep` (a dict) also receives what rebuilding its trees needs: the
    drafter's logits (tokens, L, V) and roots (tokens,) per traced position, and the token ids
    (prompt + generation) the walks follow."""
    depth = llm.spec.depth
    want = tokens + depth + 1  # every traced position's walk sees a full continuation
    sp = SamplingParams(temperature=0, max_tokens=want + 2 * depth, ignore_eos=True)
    seq = llm.add_request(prompt, sp)
    rounds = []  # (cached tokens at the round's start, committed) as the engine ran them
    while seq.num_output_tokens < want:
        before = seq.num_cached_tokens
        out_before = seq.num_output_tokens
        llm.step()
        if out_before and seq.num_output_tokens > out_before:
            rounds.append((before, seq.num_output_tokens - out_before))
    ids = list(seq.prompt_token_ids) + list(seq.output_token_ids)
    ctx = llm.spec.source.context
    kv, first = ctx.keys_values(seq.request_id)  # (C, n_layers, 2, Hkv, D), position of row 0
    assert first == 0, "context longer than the drafter's window: use shorter prompts"
    llm.abort(seq.request_id)
    drafter = llm.spec.source.drafter
    start = len(seq.prompt_token_ids)  # the first round: the prompt cached, its first token root
    paths = []
    for lo in range(start, start + tokens, chunk):
        ps = list(range(lo, min(lo + chunk, start + tokens)))
        c = max(ps)
        padded = kv[:c].unsqueeze(0).expand(len(ps), *kv[:c].shape).contiguous()  # (b, c, ...)
        logits = drafter.propose_from_kv(
            padded, torch.tensor(ps), torch.tensor([ids[p] for p in ps]), torch.tensor(ps), depth
        )  # (b, L, V)
        roots = torch.tensor([ids[p] for p in ps])  # (b,)
        tree = build_tree(logits, budget, roots)
        if keep is not None:
            keep.setdefault("logits", []).append(logits.float())  # fp32 (bf16 on CUDA)
            keep.setdefault("roots", []).append(roots)
        for i, p in enumerate(ps):
            cont = ids[p + 1 : p + 1 + depth]
            paths.append(walk(tree.tokens[i].tolist(), tree.parents[i].tolist(), cont))
    if keep is not None:
        keep["logits"], keep["roots"] = torch.cat(keep["logits"]), torch.cat(keep["roots"])
        keep["ids"] = ids
    by_pos = {start + i: len(path) for i, path in enumerate(paths)}
    check = [(p, n, by_pos.get(p)) for p, n in rounds if p in by_pos and p < start + tokens]
    bad = [c for c in check if c[1] != c[2]]
    return {"prompt_tokens": start, "paths": paths, "engine_rounds": rounds,
            "check_mismatches": bad, "checked": len(check)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--n", type=int, default=8, help="prompts per text")
    ap.add_argument("--skip", type=int, default=0, help="start at this prompt (a held-out set)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=64, help="the largest budget traced")
    ap.add_argument("--texts", default="code,prose", help="which texts to trace")
    args = ap.parse_args()
    torch.manual_seed(0)
    llm = LLM("tiny-code", device="cpu", num_pages=1024, max_num_seqs=1,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=args.budget,
              speculative_adaptive=False)  # fmt: skip
    texts = {"code": code_prompts(DATA / "tiny-code" / "heldout.json", args.skip + args.n),
             "prose": prose_prompts(PROSE, args.skip + args.n)}  # fmt: skip
    texts = {k: v[args.skip :] for k, v in texts.items() if k in args.texts.split(",")}
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "commit": _git_commit(), "command": " ".join(sys.argv), "target": "tiny-code",
           "drafter": "tiny-code-dflash", "budget": args.budget, "depth": llm.spec.depth,
           "texts": {}}  # fmt: skip
    for text, prompts in texts.items():
        out["texts"][text] = []
        for prompt in prompts:
            t = trace_prompt(llm, prompt, args.tokens, args.budget)
            print(
                f"{text}: {t['checked']} engine rounds checked, "
                f"{len(t['check_mismatches'])} mismatches",
                flush=True,
            )
            out["texts"][text].append(t)
    args.json.write_text(json.dumps(out))
    bad = sum(len(t["check_mismatches"]) for ts in out["texts"].values() for t in ts)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
