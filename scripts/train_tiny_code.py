"""Train `tiny-code`: a small Llama on the Python source found on this machine.

    PYTHONPATH=src python3 scripts/train_tiny_code.py --out OUT_DIR [--work WORK_DIR] [--smoke]

Stages (each writes its outputs as soon as it ends):
1. Corpus: every .py file of the standard library and the installed packages, sorted,
   deduplicated by content hash and by a whitespace-free hash (cheap near-duplicates). A
   held-out slice is kept apart BY PACKAGE (whole top-level packages, chosen by a fixed hash
   of the name); the held-out package list goes into OUT_DIR/heldout.json.
2. Tokenizer: ByteLevel BPE trained with `tokenizers` on the training split only, with
   <|endoftext|> (BOS/EOS), <|mask|> (DFlash's mask token) and <|pad|>; vocab padded to a
   multiple of 64 in the model.
3. Model: Llama (RMSNorm, RoPE, SwiGLU, GQA, tied embeddings) trained from scratch with AdamW,
   bf16 autocast, random 1024-token windows; parameter names are Hugging Face's, so the output
   directory (config.json, model.safetensors bf16, tokenizer.json, tokenizer_config.json,
   generation_config.json) loads through treeverify's ordinary loader.
4. Eval: held-out loss in nats/token and bits/byte, and a check that treeverify's loader gives the
   same logits as the training model.

Reproducible: fixed seeds, sorted file lists; the learning-rate schedule follows the step count
unless the wall-clock cap (--max-seconds) is reached first, which the output records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import site
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]  # ids 0, 1, 2
MAX_FILE_BYTES = 1 << 20  # larger .py files are generated tables, not code


def log(msg: str) -> None:
    print(f"[train_tiny_code {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. corpus ---------------------------------------------------------------------------------


def source_roots() -> list[Path]:
    """The standard library and every site-packages directory, deduplicated, sorted."""
    roots = {Path(sysconfig.get_paths()["stdlib"]).resolve()}
    for p in [
        *site.getsitepackages(),
        site.getusersitepackages(),
        sysconfig.get_paths()["purelib"],
    ]:
        if p and Path(p).is_dir():
            roots.add(Path(p).resolve())
    return sorted(roots)


def package_of(root: Path, path: Path) -> str:
    """'stdlib/json', 'site/torch': the top-level package (or module) a file belongs to."""
    top = path.relative_to(root).parts[0].removesuffix(".py")
    kind = "site" if root.name in ("site-packages", "dist-packages") else "stdlib"
    return f"{kind}/{top}"


def collect_files(max_files: int | None) -> list[tuple[str, str]]:
    """(package, text) of every distinct .py file, in sorted path order."""
    seen: set[bytes] = set()
    out = []
    roots = source_roots()
    for root in roots:
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            # other roots are walked on their own; never descend into them twice
            dirnames[:] = sorted(d for d in dirnames if Path(dirpath, d).resolve() not in roots
                                 and d not in ("__pycache__",))  # fmt: skip
            paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
        for path in sorted(paths):
            try:
                if path.stat().st_size > MAX_FILE_BYTES or path.is_symlink():
                    continue
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            exact = hashlib.sha256(text.encode()).digest()
            squeezed = hashlib.sha256("".join(text.split()).encode()).digest()
            if len(text) < 64 or exact in seen or squeezed in seen:
                continue
            seen.update((exact, squeezed))
            out.append((package_of(root, path), text))
            if max_files and len(out) >= max_files:
                return out
    return out


def split_by_package(files, holdout_pct: float, max_heldout_bytes: int):
    """Whole packages go to the held-out slice when crc32(name) falls in the first holdout_pct
    percent (a fixed, machine-independent choice), until max_heldout_bytes is reached."""
    sizes: dict[str, int] = {}
    for pkg, text in files:
        sizes[pkg] = sizes.get(pkg, 0) + len(text.encode())
    chosen, total = set(), 0
    for pkg in sorted(sizes, key=lambda p: (zlib.crc32(p.encode()) % 10000, p)):
        if zlib.crc32(pkg.encode()) % 10000 >= holdout_pct * 100:
            break
        if total + sizes[pkg] <= max_heldout_bytes:
            chosen.add(pkg)
            total += sizes[pkg]
    train = [t for p, t in files if p not in chosen]
    heldout = [t for p, t in files if p in chosen]
    return train, heldout, sorted(chosen)


def middle_window(text: str, chars: int) -> str:
    """`chars` characters from the first line start past a third of the file (past the license
    header and module docstring: a prompt in the middle of real code)."""
    start = text.find("\n", len(text) // 3) + 1
    return text[start : start + chars]


def corpus_split(max_files, holdout_pct, max_heldout_bytes, max_train_bytes):
    """(all files, training texts, held-out texts, held-out packages); the training texts in
    content-hash order (a fixed shuffle), capped at max_train_bytes characters."""
    files = collect_files(max_files)
    train_texts, held_texts, held_pkgs = split_by_package(files, holdout_pct, max_heldout_bytes)
    kept, size = [], 0
    for text in sorted(train_texts, key=lambda s: hashlib.sha256(s.encode()).digest()):
        if size + len(text) > max_train_bytes:
            break
        kept.append(text)
        size += len(text)
    return files, kept, held_texts, held_pkgs


# ---- 2. tokenizer ------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """One long int32 stream: <|endoftext|> before every file."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids += enc.ids
    return torch.tensor(ids, dtype=torch.int32)


CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def write_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[0], "pad_token": SPECIALS[2], "mask_token": SPECIALS[1],
        "add_bos_token": False, "model_max_length": 1024, "chat_template": CHAT_TEMPLATE,
    }, indent=2))  # fmt: skip


# ---- 3. the training-time model (Hugging Face parameter names) --------------------------------


def rope_tables(n: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    f = torch.arange(n, device=device).float()[:, None] * inv[None, :]  # (n, D/2)
    return f.cos(), f.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x (..., S, H, D), cos/sin broadcastable to (..., S, 1, D/2)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class Attn(nn.Module):
    def __init__(self, d: int, hq: int, hkv: int, hd: int):
        super().__init__()
        self.hq, self.hkv, self.hd = hq, hkv, hd
        self.q_proj = nn.Linear(d, hq * hd, bias=False)
        self.k_proj = nn.Linear(d, hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, hkv * hd, bias=False)
        self.o_proj = nn.Linear(hq * hd, d, bias=False)

    def forward(self, x, cos, sin, cache: dict | None = None):  # x (B, S, d)
        """cache (generation): {"k", "v": (B, total, Hkv, D), "start": int}; this call's K/V
        are stored at start.. and the queries see everything cached up to them."""
        b, s, _ = x.shape
        q = rotate(self.q_proj(x).view(b, s, self.hq, self.hd), cos, sin)
        k = rotate(self.k_proj(x).view(b, s, self.hkv, self.hd), cos, sin)
        v = self.v_proj(x).view(b, s, self.hkv, self.hd)
        if cache is not None:
            end = cache["start"] + s
            cache["k"][:, cache["start"] : end] = k
            cache["v"][:, cache["start"] : end] = v
            k, v = cache["k"][:, :end], cache["v"][:, :end]
        rep = self.hq // self.hkv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)  # (B, S, Hq, D)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=s > 1)  # fmt: skip
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Norm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d = c["hidden_size"]
        self.self_attn = Attn(d, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        self.mlp = Mlp(d, c["intermediate_size"])
        self.input_layernorm = Norm(d, c["rms_norm_eps"])
        self.post_attention_layernorm = Norm(d, c["rms_norm_eps"])

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = Norm(c["hidden_size"], c["rms_norm_eps"])


class TrainLlama(nn.Module):
    """forward(ids (B, S)) -> logits (B, S, V); `taps` also returns the listed layers' outputs
    (the residual stream after each, concatenated: what treeverify's engine hands a drafter)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = Body(c)
        self.model.embed_tokens.weight.data.normal_(0.0, 0.02)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # scaled residual writes
                p.data.normal_(0.0, 0.02 / math.sqrt(2 * c["num_hidden_layers"]))
            elif p.dim() == 2 and "embed" not in name:
                p.data.normal_(0.0, 0.02)

    def forward(self, ids, taps: list[int] | None = None, last_only: bool = False,
                caches: list[dict] | None = None):  # fmt: skip
        start = caches[0]["start"] if caches else 0
        cos, sin = rope_tables(start + ids.shape[1], self.c["head_dim"], self.c["rope_theta"],
                               ids.device)  # fmt: skip
        cos, sin = cos[start:, None, :], sin[start:, None, :]  # (S, 1, D/2)
        x = self.model.embed_tokens(ids)
        tapped = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, caches[i] if caches else None)
            if taps and i in taps:
                tapped.append(x)
        if last_only:
            x = x[:, -1:]
        logits = F.linear(self.model.norm(x), self.model.embed_tokens.weight)  # tied head
        return (logits, torch.cat(tapped, -1)) if taps else logits

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, new: int, dtype=torch.bfloat16) -> torch.Tensor:
        """(B, P) -> (B, P + new): greedy continuation with a K/V cache."""
        b, p = ids.shape
        c, dev = self.c, ids.device
        shape = (b, p + new, c["num_key_value_heads"], c["head_dim"])
        caches = [{"k": torch.zeros(shape, dtype=dtype, device=dev),
                   "v": torch.zeros(shape, dtype=dtype, device=dev), "start": 0}
                  for _ in range(c["num_hidden_layers"])]  # fmt: skip
        out, x = [ids], ids
        for _ in range(new):
            with torch.autocast(dev.type, dtype, enabled=dev.type == "cuda"):
                logits = self(x, last_only=True, caches=caches)
            for cache in caches:
                cache["start"] += x.shape[1]
            x = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out.append(x)
        return torch.cat(out, 1)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", torch.bfloat16).contiguous()
                for k, v in self.state_dict().items()}  # fmt: skip


def hf_config(c: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
        "hidden_act": "silu", "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"], "rope_scaling": None,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


def load_train_llama(directory: Path, device) -> TrainLlama:
    """The training-time model with a saved tiny-code's weights (for the drafter's training)."""
    from safetensors.torch import load_file

    c = json.loads((directory / "config.json").read_text())
    model = TrainLlama(c)
    state = load_file(str(directory / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device)


def random_windows(stream: torch.Tensor, n: int, length: int, g: torch.Generator):
    starts = torch.randint(0, len(stream) - length, (n,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()  # (n, length)


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int, device, max_windows: int) -> dict:
    """Mean next-token CE over non-overlapping windows of the held-out stream."""
    model.eval()
    n = min((len(stream) - 1) // seq, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = [stream[j * seq : j * seq + seq + 1] for j in range(i, min(i + 16, n))]
        x = torch.stack(rows).long().to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += ce.item()
        count += x[:, 1:].numel()
    return {"tokens": count, "nats_per_token": total / max(count, 1)}


def train(model, stream, args, device) -> dict:
    g = torch.Generator().manual_seed(args.seed + 1)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")  # fmt: skip
    step_fn = model
    if args.compile and device.type == "cuda":
        step_fn = torch.compile(model)
    warm = max(1, args.steps // 50)
    t0, step, losses = time.perf_counter(), 0, []
    model.train()
    while step < args.steps:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.steps, elapsed / args.max_seconds)
        if progress >= 1.0:
            break
        lr = (
            args.lr
            * min(1.0, (step + 1) / warm)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        x = random_windows(stream, args.batch, args.seq + 1, g).to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = step_fn(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            losses.append((step, round(loss.item(), 4)))
            log(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {time.perf_counter() - t0:.0f} s")
    secs = time.perf_counter() - t0
    return {"steps": step, "seconds": round(secs, 1), "tokens": step * args.batch * args.seq,
            "stopped_by": "steps" if step >= args.steps else "max_seconds",
            "loss_curve": losses}  # fmt: skip


@torch.no_grad()
def loader_agrees(out: Path, model: TrainLlama, stream: torch.Tensor, device) -> float:
    """Max |logit difference| between treeverify's loader (fp32) and the training model (fp32
    with the saved bf16 weights) on one held-out window: the shipped directory is what we
    trained."""
    from treeverify.models import load_model

    _, ours, _ = load_model(out, dtype=torch.float32, device=device)
    ref = load_train_llama(out, device).eval()
    ids = stream[:256].long().to(device)
    a = ours(ids, torch.arange(len(ids), device=device))
    b = ref(ids[None])[0].float()
    return (a - b).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the model directory to write")
    p.add_argument("--work", type=Path, default=None, help="token streams for the drafter")
    p.add_argument("--smoke", action="store_true", help="tiny everything (a CPU check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8000)
    p.add_argument("--max-seconds", type=float, default=180.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-train-bytes", type=int, default=200_000_000)
    p.add_argument("--tokenizer-bytes", type=int, default=48_000_000)
    p.add_argument("--holdout-pct", type=float, default=6.0)
    p.add_argument("--max-heldout-bytes", type=int, default=3_000_000)
    p.add_argument("--compile", action="store_true", help="torch.compile the training step")
    p.add_argument("--log-every", type=int, default=250)
    args = p.parse_args(argv)
    # head_dim 64: a head size treeverify's CUDA tree-attention kernels take (32 is not one)
    shape = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=640)  # fmt: skip
    max_files = None
    if args.smoke:
        args.steps, args.batch, args.seq, args.vocab, args.log_every = 12, 4, 128, 512, 4
        args.max_train_bytes, args.tokenizer_bytes = 2_000_000, 1_000_000
        args.holdout_pct, args.max_heldout_bytes, max_files = 30.0, 200_000, 1500
        shape = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128)  # fmt: skip
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or out.parent / (out.name + "-work")
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"python": sys.version.split()[0], "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip

    t = time.perf_counter()
    files, train_texts, held_texts, held_pkgs = corpus_split(
        max_files, args.holdout_pct, args.max_heldout_bytes, args.max_train_bytes
    )
    size = sum(len(x) for x in train_texts)
    corpus = {"roots": [str(r) for r in source_roots()], "unique_files": len(files),
              "train_files": len(train_texts), "train_chars": size,
              "heldout_files": len(held_texts), "heldout_packages": held_pkgs,
              "heldout_chars": sum(len(x) for x in held_texts),
              "seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
    log(f"corpus: {json.dumps({k: v for k, v in corpus.items() if k != 'heldout_packages'})}")

    t = time.perf_counter()
    tok_texts, n = [], 0
    for text in train_texts:
        if n > args.tokenizer_bytes:
            break
        tok_texts.append(text)
        n += len(text)
    tok = train_tokenizer(tok_texts, args.vocab)
    write_tokenizer(tok, out)
    train_stream = encode_stream(tok, train_texts)
    held_stream = encode_stream(tok, held_texts)
    held_bytes = sum(len(x.encode()) for x in held_texts)
    torch.save({"train": train_stream, "heldout": held_stream}, work / "streams.pt")
    vocab = (tok.get_vocab_size() + 63) // 64 * 64
    corpus.update(train_tokens=len(train_stream), heldout_tokens=len(held_stream),
                  heldout_bytes_per_token=round(held_bytes / len(held_stream), 4),
                  tokenizer_vocab=tok.get_vocab_size(), model_vocab=vocab,
                  tokenizer_seconds=round(time.perf_counter() - t, 1))  # fmt: skip
    log(f"tokens: train {len(train_stream)}, held-out {len(held_stream)}, "
        f"bytes/token {corpus['heldout_bytes_per_token']}")  # fmt: skip
    # A held-out slice small enough to ship (the CPU loss test) and prompts for acceptance runs.
    slice_text = "".join(held_texts)[:8192]
    prompts = [middle_window(t, 600) for t in held_texts if len(t) >= 1800][:64]
    (out.parent / "heldout.json").write_text(json.dumps(
        {"packages": held_pkgs, "slice": slice_text, "prompts": prompts}, indent=1))  # fmt: skip

    c = dict(shape, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
             max_position_embeddings=args.seq)  # fmt: skip
    model = TrainLlama(c).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, {json.dumps(c)}")
    try:
        run = train(model, train_stream, args, device)
    except Exception as exc:  # a compile failure: train eagerly instead
        if not args.compile:
            raise
        log(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly")
        model = TrainLlama(c).to(device)
        args.compile = False
        run = train(model, train_stream, args, device)
        run["compile_failed"] = True
    from safetensors.torch import save_file

    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(c), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0,
                                                            "eos_token_id": 0}))  # fmt: skip
    model = load_train_llama(out, device)  # evaluate what was saved (bf16 weights)
    ev = heldout_loss(model, held_stream, args.seq, device, max_windows=512)
    ev["bits_per_byte"] = ev["nats_per_token"] / math.log(2) / corpus["heldout_bytes_per_token"]
    ev["chance_nats"] = math.log(vocab)
    ev["train_loss_last"] = run["loss_curve"][-1][1] if run["loss_curve"] else None
    ev["loader_max_abs_logit_diff"] = loader_agrees(out, model, held_stream, device)
    summary.update(corpus=corpus, params=n_params, config=c, train=run, heldout=ev,
                   weights_bytes=(out / "model.safetensors").stat().st_size)  # fmt: skip
    (out.parent / "tiny-code-train.json").write_text(json.dumps(summary, indent=1))
    log(f"held-out: {json.dumps(ev)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
