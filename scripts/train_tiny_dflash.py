"""Train `tiny-code-dflash`: tiny-code's DFlash drafter, in the published DFlash v1 layout.

    PYTHONPATH=src python3 scripts/train_tiny_dflash.py --target TINY_CODE_DIR --out OUT_DIR
        [--streams WORK/streams.pt] [--smoke]

Recipe (shared/design/dflash-and-adaptive.md section 1, SpecForge-style):
1. Data: the TARGET'S OWN greedy continuations of random training-corpus windows (the held-out
   packages never appear: the streams file keeps them apart), generated here by the frozen target.
2. Online features: the frozen target runs over each (prompt + continuation) and hands over the
   outputs of its `target_layer_ids` layers (the residual stream, as treeverify's engine taps it).
3. Random anchors in the continuation, drawn afresh every step; each anchor i gives a block
   [x_i, MASK x (block-1)] at positions i..i+block-1 whose rows see the context rows strictly
   before i and their own block (never other blocks), all blocks of a sequence in one forward.
4. Loss: position k predicts x_{i+k}; CE weighted by exp(-(k-1)/gamma), normalised.
The drafter's parameters are treeverify's `DFlashDrafter` (published names); the embedding table
and lm_head are the target's, frozen. Written with `save_dflash` (what `load_dflash` reads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_code import (  # noqa: E402
    corpus_split,
    encode_stream,
    load_train_llama,
    random_windows,
    rotate,
)

from treeverify.models.config import RopeConfig  # noqa: E402
from treeverify.spec.dflash import DFlashDrafter  # noqa: E402
from treeverify.spec.dflash_config import (
    WEIGHTS_FILE,  # noqa: E402
    DFlashConfig,  # noqa: E402
)
from treeverify.spec.dflash_io import read_dflash_config, save_dflash  # noqa: E402


def log(msg: str) -> None:
    print(f"[train_tiny_dflash {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def greedy_continuations(target, prompts: torch.Tensor, new: int, batch: int) -> torch.Tensor:
    """(N, P) prompts -> (N, P + new) with the target's greedy tokens."""
    dev = next(target.parameters()).device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return torch.cat([target.greedy(prompts[i : i + batch].to(dev), new, dtype).cpu()
                      for i in range(0, len(prompts), batch)])  # fmt: skip


def load_streams(args) -> dict:
    """The training token stream train_tiny_code saved, or (no such file: a fresh machine) the
    same corpus split re-read from disk and encoded with the target's tokenizer."""
    path = args.streams or args.target.parent / (args.target.name + "-work") / "streams.pt"
    if path.is_file():
        return torch.load(path)
    from tokenizers import Tokenizer

    log(f"{path} not found: re-reading the corpus ({args.corpus_bytes} characters)")
    files, train_texts, _, _ = corpus_split(
        1500 if args.smoke else None,
        30.0 if args.smoke else 6.0,
        200_000 if args.smoke else 3_000_000,
        args.corpus_bytes,
    )  # fmt: skip (train_tiny_code's defaults: the same held-out packages stay out)
    # ... and the packages the target's held-out slice came from, by name: the split above
    # depends on package sizes, which another machine's installs may change
    heldout = args.target / "heldout.json"
    if heldout.is_file():
        names = set(json.loads(heldout.read_text())["packages"])
        of = {text: pkg for pkg, text in files}
        kept = [t for t in train_texts if of.get(t) not in names]
        log(f"held-out packages of {heldout}: {len(train_texts) - len(kept)} files left out")
        train_texts = kept
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    return {"train": encode_stream(tok, train_texts)}


def draft_forward(drafter: DFlashDrafter, embed_w, feats, tokens, anchors):
    """Training forward of all anchors' blocks of B sequences at once.

    feats (B, S, F) target features; tokens (B, S); anchors (B, A) positions (sorted or not).
    Returns logits (B, A, T-1, V) for block positions 1..T-1.
    """
    cfg = drafter.config
    b, s, _ = feats.shape
    a, t = anchors.shape[1], drafter.block_size
    dev = feats.device
    ctx = drafter.hidden_norm(drafter.fc(feats))  # (B, S, H)
    blk = torch.full((b, a, t), drafter.mask_token_id, dtype=torch.long, device=dev)
    blk[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(blk, embed_w).reshape(b, a * t, -1)  # (B, A*T, H)
    pos = torch.cat(
        [
            torch.arange(s, device=dev)[None].expand(b, s),
            (anchors[:, :, None] + torch.arange(t, device=dev)).reshape(b, a * t),
        ],
        1,
    )
    cos, sin = drafter.rope(pos.reshape(-1))  # (B*(S+AT), D/2)
    cos, sin = cos.view(b, s + a * t, 1, -1), sin.view(b, s + a * t, 1, -1)
    cq, sq = cos[:, s:], sin[:, s:]
    # Visibility: block rows of anchor i see context rows j < i and their own block only.
    see_ctx = torch.arange(s, device=dev)[None, None, :] < anchors[:, :, None]  # (B, A, S)
    see_ctx = see_ctx[:, :, None, :].expand(b, a, t, s).reshape(b, a * t, s)
    blk_id = torch.arange(a * t, device=dev) // t
    see_blk = (blk_id[:, None] == blk_id[None, :])[None].expand(b, a * t, a * t)
    mask = torch.cat([see_ctx, see_blk], 2)[:, None]  # (B, 1, A*T, S+A*T)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in drafter.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx.to(h.dtype), h], 1)  # (B, S+AT, H)
        q = rotate(att.q_norm(att.q_proj(h).view(b, a * t, hq, d)), cq, sq)
        k = rotate(att.k_norm(att.k_proj(kv_in).view(b, s + a * t, hkv, d)), cos, sin)
        v = att.v_proj(kv_in).view(b, s + a * t, hkv, d)
        k, v = k.repeat_interleave(hq // hkv, 2), v.repeat_interleave(hq // hkv, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask)  # fmt: skip
        x = x + att.o_proj(o.transpose(1, 2).reshape(b, a * t, hq * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = drafter.norm(x).view(b, a, t, -1)[:, :, 1:]  # (B, A, T-1, H)
    return F.linear(h, embed_w)  # (B, A, T-1, V)


def block_loss(logits, tokens, anchors, gamma: float):
    """Decayed per-position CE; targets past the sequence end are left out."""
    b, a, l, v = logits.shape
    s = tokens.shape[1]
    k = torch.arange(1, l + 1, device=tokens.device)
    where = anchors[:, :, None] + k  # (B, A, L)
    valid = where < s
    tgt = tokens.gather(1, where.clamp(max=s - 1).reshape(b, -1)).view(b, a, l)
    ce = F.cross_entropy(logits.float().reshape(-1, v), tgt.reshape(-1), reduction="none")
    w = torch.exp(-(k - 1).float() / gamma)[None, None, :] * valid
    loss = (ce.view(b, a, l) * w).sum() / w.sum()
    with torch.no_grad():  # accepted-prefix length of a greedy chain, per anchor
        hit = (logits.argmax(-1) == tgt) & valid
        chain = hit.long().cumprod(-1).sum(-1).float().mean()
    return loss, chain


@torch.no_grad()
def validate(drafter, target, val, taps, lo, gamma, g) -> tuple[float, float]:
    """Loss and greedy chain tau (accepted prefix + 1) on continuations never trained on."""
    drafter.eval()
    dev = next(drafter.parameters()).device
    losses, taus = [], []
    for i in range(0, len(val), 32):
        tokens = val[i : i + 32].to(dev)
        s = tokens.shape[1]
        anchors = torch.stack([lo + torch.randperm(s - 1 - lo, generator=g)[:32]
                               for _ in range(len(tokens))]).to(dev)  # fmt: skip
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            _, feats = target(tokens, taps=taps)
            logits = draft_forward(drafter, target.model.embed_tokens.weight, feats, tokens,
                                   anchors)  # fmt: skip
        loss, chain = block_loss(logits, tokens, anchors, gamma)
        losses.append(loss.item())
        taus.append(chain.item() + 1)
    drafter.train()
    return round(sum(losses) / len(losses), 4), round(sum(taus) / len(taus), 3)


def start_from(drafter: DFlashDrafter, directory: Path) -> None:
    """Load a saved drafter's weights into `drafter` (fp32 for training); its config must be
    the one this run builds (a different shape or tap set is a ValueError naming both)."""
    from safetensors.torch import load_file

    want = drafter.config.to_hf_dict(torch.bfloat16)
    have = read_dflash_config(directory).to_hf_dict(torch.bfloat16)
    if have != want:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ValueError(f"--init {directory}: its config differs from this run's in {diff}")
    state = load_file(str(directory / WEIGHTS_FILE))
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--streams", type=Path, default=None, help="default: TARGET-work/streams.pt")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--corpus-bytes", type=int, default=40_000_000, help="without --streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--taps", default="1,4,7", help="target layers whose outputs are the context")
    p.add_argument("--prompts", type=int, default=65536, help="greedy continuations to generate")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--gen-batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--max-seconds", type=float, default=200.0)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", type=Path, default=None,
                   help="start from this drafter's weights (a directory save_dflash wrote, the "
                        "same config), e.g. the shipped one, and train on (with --seed: new "
                        "continuations)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=500)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_len, args.new_tokens, args.gen_batch = 16, 32, 24, 8
        args.steps, args.batch, args.anchors, args.log_every, args.block = 6, 4, 4, 2, 8
        args.taps = "0,2,3"
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_train_llama(args.target, dev).eval().requires_grad_(False)
    tc = target.c
    streams = load_streams(args)
    g = torch.Generator().manual_seed(args.seed + 2)

    t0 = time.perf_counter()
    stream = streams["train"]
    cut = len(stream) * 19 // 20  # validation prompts come from the last 5%, never trained on
    prompts = random_windows(stream[:cut], args.prompts, args.prompt_len, g)
    seqs = greedy_continuations(target, prompts, args.new_tokens, args.gen_batch)  # (N, S)
    val_prompts = random_windows(stream[cut:], 256 if not args.smoke else 4, args.prompt_len, g)
    val = greedy_continuations(target, val_prompts, args.new_tokens, args.gen_batch)
    gen_s = time.perf_counter() - t0
    log(f"{len(seqs)} greedy continuations of {args.new_tokens} tokens in {gen_s:.0f} s")

    taps = [int(x) for x in args.taps.split(",")]
    mask_id = 1  # <|mask|>, reserved by train_tiny_code's tokenizer
    cfg = DFlashConfig(
        hidden_size=tc["hidden_size"], num_hidden_layers=args.layers, num_attention_heads=8
        if not args.smoke else 4, num_key_value_heads=4 if not args.smoke else 2,
        head_dim=32 if not args.smoke else 16, intermediate_size=tc["intermediate_size"],
        block_size=args.block, mask_token_id=mask_id, target_layer_ids=taps,
        vocab_size=tc["vocab_size"], num_target_layers=tc["num_hidden_layers"],
        rms_norm_eps=tc["rms_norm_eps"], rope=RopeConfig(theta=tc["rope_theta"]),
    )  # fmt: skip
    torch.manual_seed(args.seed + 3)
    drafter = DFlashDrafter(cfg).to(dev)
    if args.init is not None:
        start_from(drafter, args.init)
        log(f"started from {args.init}")
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M parameters, taps {taps}, block {args.block}")
    embed_w = target.model.embed_tokens.weight  # frozen, shared
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(args.block, args.block / 2.3)
    lo = args.prompt_len  # anchors: the first generated token onwards (the engine's rounds)
    warm = max(1, args.steps // 25)
    t0, step, curve = time.perf_counter(), 0, []
    drafter.train()
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - t0) / args.max_seconds)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, len(seqs), (args.batch,), generator=g)
        tokens = seqs[rows].to(dev)  # (B, S)
        s = tokens.shape[1]
        anchors = torch.stack([lo + torch.randperm(s - 1 - lo, generator=g)[: args.anchors]
                               for _ in range(args.batch)]).to(dev)  # fmt: skip
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            with torch.no_grad():
                _, feats = target(tokens, taps=taps)  # (B, S, len(taps) * H)
            logits = draft_forward(drafter, embed_w, feats, tokens, anchors)
        loss, chain = block_loss(logits, tokens, anchors, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            vl, vt = validate(drafter, target, val, taps, lo, gamma, g) if step > 1 else (0, 0)
            curve.append((step, round(loss.item(), 4), round(chain.item() + 1, 3), vl, vt))
            log(f"step {step} loss {loss.item():.4f} chain tau {chain.item() + 1:.2f} | "
                f"validation loss {vl} chain tau {vt} | lr {lr:.2e} "
                f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    secs = time.perf_counter() - t0
    drafter = drafter.to(torch.bfloat16).eval()
    save_dflash(drafter, args.out)
    summary = {"params": n_params, "config": cfg.to_hf_dict(torch.bfloat16),
               "generation": {"prompts": len(seqs), "prompt_len": args.prompt_len,
                              "new_tokens": args.new_tokens, "seconds": round(gen_s, 1)},
               "train": {"steps": step, "seconds": round(secs, 1), "gamma": gamma,
                         "anchors": args.anchors, "batch": args.batch,
                         "stopped_by": "steps" if step >= args.steps else "max_seconds",
                         "curve": curve},
               "init": None if args.init is None else str(args.init), "seed": args.seed,
               "weights_bytes": (args.out / "model.safetensors").stat().st_size}  # fmt: skip
    (args.out.parent / "tiny-code-dflash-train.json").write_text(json.dumps(summary, indent=1))
    log(f"saved {args.out} ({summary['weights_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
