"""`EngineConfig`: every knob `LLM` takes, validated once, and the sizes derived from them.

    cfg = EngineConfig("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8)
    cfg.tree_sizes        # (5, 9): verify-graph tokens per sequence, one per round budget
    llm = LLM(config=cfg)  # same as LLM("tiny-llama", speculative_algorithm="DDTREE", ...)

Frozen: what the engine was built with cannot drift from what it runs. Two values are known only
once the engine has loaded things: the KV pool size on a GPU (`num_pages=None`: sized from
`mem_fraction_static` after the weights are in memory) and the draft depth
(`speculative_num_draft_tokens=None`: the drafter's own, DFlash block - 1, n-gram 4).
`LLM` fills them with `resolved(...)`, a new frozen config; `llm.config` is always resolved.
Derived sizes are computed on first use and kept (`functools.cached_property`); one that needs
an unresolved value raises RuntimeError naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from treeverify import env
from treeverify.engine.budget_config import ControllerConfig
from treeverify.engine.budget_controller import CLOCKS, budget_buckets
from treeverify.engine.cuda_graphs import batch_buckets
from treeverify.kernels.api import BACKENDS

SPECULATIVE_ALGORITHMS = ("DDTREE", "CHAIN")
MAX_TREE_BUDGET = 1024  # the verify kernels' largest tree is 1025 nodes
CPU_NUM_PAGES = 512  # the CPU engine's pool when none is given
DEFAULT_GRAPH_MAX_BS = 32


def tree_nodes(algorithm: str, budget: int, depth: int) -> int:
    """Nodes of a budget-`budget` round's tree, root included (its verify bucket's n): DDTree's
    fixed width budget + 1 (padding nodes when fewer paths exist); a chain stops at the depth."""
    if algorithm == "CHAIN":
        return 1 + min(depth, budget)
    return 1 + budget


# Requests decoding at once: each has a row in tables allocated at startup (penalties and
# logit_bias: max_num_seqs x vocab); 10**9 failed deep in torch's allocator (a new user's audit).
MAX_NUM_SEQS = 1 << 16


def _positive_int(name: str, v: object, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        what = "None or an int >= 1" if allow_none else "an int >= 1"
        raise ValueError(f"{name} must be {what}, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs (`LLM`'s keyword arguments, same names and defaults)."""

    model: str = "tiny-llama"
    num_pages: int | None = None  # None: 512 on the CPU, from mem_fraction_static on a GPU
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int | None = None  # None: max_num_batched_tokens
    attention_backend: str = "auto"  # auto: cuda on a GPU, torch on the CPU
    device: str | torch.device = "cpu"  # kept as a torch.device
    dtype: torch.dtype | None = None  # None: bf16 on a GPU, fp32 on the CPU
    seed: int = 0
    speculative_algorithm: str | None = None  # "DDTREE" | "CHAIN" | None
    speculative_ddtree_budget: int = 16  # tree nodes besides the root
    speculative_num_draft_tokens: int | None = None  # depth L; None: DFlash block-1, else 4
    # "ngram", a shipped drafter name, a DFlash directory; None: the model's own shipped
    # drafter if it has one (tiny-code -> tiny-code-dflash), else "ngram"
    speculative_draft_model_path: str | None = None
    # Per-step budget from measured acceptance and cost, 0 (plain) included, up to
    # speculative_ddtree_budget; None: on for DDTREE (engine/budget_controller.py).
    speculative_adaptive: bool | None = None
    # A fixed cost curve (seconds per step at batch 1 per budget bucket) instead of measured
    speculative_cost_seconds: Mapping[int, float] | None = field(default=None, hash=False)
    speculative_cost_clock: str = "wall"  # or "process" (budget_controller.CLOCKS)
    # The adaptive budget controller's knobs as "KNOB=VALUE" (engine/budget_config.py
    # ControllerConfig; e.g. "plain_margin=0.05"), each parsed and validated here
    speculative_controller: tuple[str, ...] = ()
    mem_fraction_static: float = 0.88
    cuda_graph_max_bs: int | None = None  # None: min(max_num_seqs, 32)
    disable_cuda_graph: bool = False
    # Greedy DFlash and n-gram rounds as one replay each (engine/round_graphs.py; eager on the
    # CPU); True: every round takes the general path (draft, build, verify, accept one by one)
    disable_round_graphs: bool = False
    # Whole rounds for the n-gram drafter too (its history in device rings, engine/ngram_rings.py;
    # on the H200 1.7-2.3x the general path's tokens/s on tiny-code, docs/performance.md,
    # sixteenth session); False: every n-gram round takes the general path (host votes)
    ngram_whole_rounds: bool = True
    # Launch a whole round's successor before reading its result, so the host's bookkeeping
    # overlaps the GPU (engine/round_graphs.py); None: on where rounds are captured (a GPU with
    # graphs), off on the CPU (nothing to overlap there; the tests turn it on)
    round_lookahead: bool | None = None
    # Launch each plain greedy decode step before reading the previous one's tokens, so the
    # host's part overlaps the GPU (engine/decode_ahead.py); None: on where graphs are captured
    # unless TREEVERIFY_DECODE_LOOKAHEAD=0; True on the CPU runs the same bookkeeping eagerly
    # (the tests)
    decode_lookahead: bool | None = None
    # One request's prefill chunk of <= 512 tokens through a captured chain bucket (1, n) on a
    # GPU (engine/model_runner.py, `prefill_graph_sizes`); True: such prefills run eagerly
    disable_prefill_graphs: bool = False

    def __post_init__(self) -> None:
        self._validate()
        # Normalised forms ("auto" and None made concrete where the device decides).
        dev = torch.device(self.device)
        on_gpu = dev.type == "cuda"
        set_ = functools.partial(object.__setattr__, self)
        set_("device", dev)
        if self.dtype is None:
            set_("dtype", torch.bfloat16 if on_gpu else torch.float32)
        if self.attention_backend == "auto":
            set_("attention_backend", "cuda" if on_gpu else "torch")
        if self.num_pages is None and not on_gpu:
            set_("num_pages", CPU_NUM_PAGES)
        set_("speculative_controller", tuple(self.speculative_controller))
        if self.speculative_cost_seconds is not None:  # read-only: the config is frozen
            set_("speculative_cost_seconds", types.MappingProxyType(
                {int(k): float(v) for k, v in self.speculative_cost_seconds.items()}))  # fmt: skip

    def _validate(self) -> None:
        """ValueError naming the argument (the messages the engine's parts used before)."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: expected a model name or path, got {self.model!r}")
        _positive_int("num_pages", self.num_pages, allow_none=True)
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        if self.max_num_seqs > MAX_NUM_SEQS:  # its per-request tables are allocated at startup
            raise ValueError(f"max_num_seqs: expected at most {MAX_NUM_SEQS}, got "
                             f"{self.max_num_seqs}")  # fmt: skip
        _positive_int("chunked_prefill_size", self.chunked_prefill_size, allow_none=True)
        _positive_int("cuda_graph_max_bs", self.cuda_graph_max_bs, allow_none=True)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: expected one of {list(BACKENDS)}, got "
                             f"{self.attention_backend!r}")  # fmt: skip
        if self.dtype is not None and (
            not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point
        ):
            raise ValueError(f"dtype: expected None or a floating torch.dtype, got {self.dtype!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: {self.device!r} is not a device ({exc})") from None
        if self.attention_backend == "cuda" and dev.type != "cuda":
            raise ValueError("attention_backend: 'cuda' runs on a GPU only (device "
                             f"{str(dev)!r}); 'auto' picks torch on the CPU")  # fmt: skip
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {self.seed!r}")
        for name in ("disable_cuda_graph", "disable_round_graphs", "ngram_whole_rounds",
                     "disable_prefill_graphs"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):  # "no" would count as True
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("speculative_adaptive", "round_lookahead", "decode_lookahead"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected None or a bool, got {getattr(self, name)!r}")
        path = self.speculative_draft_model_path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"speculative_draft_model_path: expected a name or a path, got "
                             f"{path!r}")  # fmt: skip
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static: expected a fraction in (0, 1), got "
                             f"{self.mem_fraction_static}")  # fmt: skip
        algo = self.speculative_algorithm
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm: expected one of "
                             f"{list(SPECULATIVE_ALGORITHMS)} or None, got {algo!r}")  # fmt: skip
        if algo is None:  # set without it, a speculative knob was silently dropped
            for f in dataclasses.fields(self):
                if f.name.startswith("speculative_") and f.name != "speculative_algorithm":
                    value = getattr(self, f.name)
                    if value is not None and value != f.default:
                        raise ValueError(f"{f.name}: set without speculative_algorithm (DDTREE "
                                         f"or CHAIN): no speculation would use it")  # fmt: skip
        b = self.speculative_ddtree_budget
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_TREE_BUDGET:
            raise ValueError(f"speculative_ddtree_budget: expected an int in 1..{MAX_TREE_BUDGET}"
                             f", got {b!r}")  # fmt: skip
        _positive_int("speculative_num_draft_tokens", self.speculative_num_draft_tokens,
                      allow_none=True)  # fmt: skip
        if self.speculative_cost_clock not in CLOCKS:
            raise ValueError(f"speculative_cost_clock: expected one of {list(CLOCKS)}, got "
                             f"{self.speculative_cost_clock!r}")  # fmt: skip
        if self.speculative_adaptive and algo != "DDTREE":
            raise ValueError(f"speculative_adaptive: needs speculative_algorithm DDTREE, got "
                             f"{algo!r}")  # fmt: skip
        knobs = self.speculative_controller
        if isinstance(knobs, str) or not all(isinstance(k, str) for k in knobs):
            raise ValueError(f"speculative_controller: expected a sequence of 'KNOB=VALUE' "
                             f"strings, got {knobs!r}")  # fmt: skip
        if knobs and not self.adaptive:
            raise ValueError(
                "speculative_controller: needs the adaptive budget "
                "(speculative_algorithm DDTREE, speculative_adaptive not False)"
            )
        try:
            ControllerConfig().with_settings(list(knobs))
        except ValueError as exc:
            raise ValueError(f"speculative_controller: {exc}") from None
        costs = self.speculative_cost_seconds
        if costs is not None and self.adaptive:
            if missing := [b for b in self.budget_buckets if b not in costs]:
                raise ValueError(f"speculative_cost_seconds: no cost for budget(s) {missing} "
                                 f"(buckets {list(self.budget_buckets)})")  # fmt: skip
            if bad := {b: s for b, s in costs.items() if not s > 0}:
                raise ValueError(f"speculative_cost_seconds: expected seconds > 0, got {bad}")

    def resolved(self, **facts) -> EngineConfig:
        """A copy with values only the engine learns (num_pages, speculative_num_draft_tokens)
        filled in; validated again."""
        unknown = set(facts) - {"num_pages", "speculative_num_draft_tokens"}
        if unknown:
            raise ValueError(f"resolved: only num_pages / speculative_num_draft_tokens, got "
                             f"{sorted(unknown)}")  # fmt: skip
        return dataclasses.replace(self, **facts)

    def _need(self, name: str):
        v = getattr(self, name)
        if v is None:
            raise RuntimeError(f"EngineConfig.{name} is not resolved yet (the LLM fills it in "
                               f"at startup; use llm.config)")  # fmt: skip
        return v

    # ---- derived: computed on first use, then kept ---------------------------------------------
    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @functools.cached_property
    def speculating(self) -> bool:
        return self.speculative_algorithm is not None

    @functools.cached_property
    def max_budget(self) -> int:
        """The largest tree budget a round may use (0: no speculation)."""
        return self.speculative_ddtree_budget if self.speculating else 0

    @functools.cached_property
    def lookahead(self) -> bool:
        """Whether whole rounds launch their successor before their result is read."""
        if self.round_lookahead is not None:
            return self.round_lookahead
        return self.on_gpu and not self.disable_cuda_graph

    @functools.cached_property
    def plain_lookahead(self) -> bool:
        """Whether plain greedy decode steps launch their successor before being read."""
        if self.decode_lookahead is not None:
            return self.decode_lookahead
        return self.on_gpu and not self.disable_cuda_graph and env.decode_lookahead()

    @functools.cached_property
    def adaptive(self) -> bool:
        """Whether a budget controller picks each step's budget (DDTREE unless turned off)."""
        return self.speculative_algorithm == "DDTREE" and self.speculative_adaptive is not False

    @property
    def controller_config(self) -> ControllerConfig:
        """The adaptive budget controller's knobs: the defaults with `speculative_controller`."""
        return ControllerConfig().with_settings(list(self.speculative_controller))

    @functools.cached_property
    def budget_buckets(self) -> tuple[int, ...]:
        """The adaptive controller's budgets, 0 (a plain step) first; () without it."""
        return budget_buckets(self.speculative_ddtree_budget) if self.adaptive else ()

    @functools.cached_property
    def spec_budgets(self) -> tuple[int, ...]:
        """Budgets a round may use: the controller's nonzero buckets, or the configured one."""
        if not self.speculating:
            return ()
        if self.adaptive:
            return tuple(b for b in self.budget_buckets if b > 0)
        return (self.speculative_ddtree_budget,)

    @functools.cached_property
    def tree_size(self) -> int:
        """Nodes of a round's tree at the largest budget, root included (0: no speculation)."""
        return self.tree_size_for(self.max_budget) if self.speculating else 0

    def tree_size_for(self, budget: int) -> int:
        """Nodes of a budget-`budget` round's tree, root included (a chain's needs the depth)."""
        if self.speculative_algorithm == "CHAIN":
            return tree_nodes("CHAIN", budget, self._need("speculative_num_draft_tokens"))
        return tree_nodes("DDTREE", budget, 0)

    @functools.cached_property
    def tree_sizes(self) -> tuple[int, ...]:
        """Verify-graph token counts per sequence, one per round budget (() without
        speculation)."""
        return tuple(sorted({self.tree_size_for(b) for b in self.spec_budgets}))

    @functools.cached_property
    def prefill_chunk(self) -> int:
        """The most prompt tokens of one sequence a step runs."""
        return min(self.chunked_prefill_size or self.max_num_batched_tokens,
                   self.max_num_batched_tokens)  # fmt: skip

    @functools.cached_property
    def max_forward_tokens(self) -> int:
        """Rows of one forward at most: the step's token budget plus every sequence's tree."""
        return self.max_num_batched_tokens + self.max_num_seqs * self.max_budget

    @functools.cached_property
    def max_chunk(self) -> int:
        """The most tokens of one sequence in one forward: a prefill chunk or a whole tree."""
        return max(self.prefill_chunk, self.max_budget + 1)

    @functools.cached_property
    def graph_max_bs(self) -> int:
        """The largest batch a captured graph (and a bucket-sized plan) serves."""
        return min(self.cuda_graph_max_bs or DEFAULT_GRAPH_MAX_BS, self.max_num_seqs)

    @functools.cached_property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        return tuple(batch_buckets(self.graph_max_bs))

    @functools.cached_property
    def prefill_graph_sizes(self) -> tuple[int, ...]:
        """Token buckets n of one request's prefill chunk run as a chain of n rows, padded
        (bucket (1, n)): 32 .. 512 up to the prefill chunk, none that is also a tree size (a
        tree bucket's last row is not the chunk's); () when disabled. On a small model an eager
        prefill is host-bound (a 164-token prompt: 6.8 ms for 0.35 ms of GPU on the H200)."""
        if self.disable_prefill_graphs:
            return ()
        sizes = (32, 64, 128, 256, 512)
        return tuple(n for n in sizes if n <= self.prefill_chunk and n not in self.tree_sizes)

    @functools.cached_property
    def graph_buckets(self) -> tuple[tuple[int, int], ...]:
        """(batch, tokens per sequence) of every forward with its own graph (or, without graphs
        on a GPU, its own plans): plain decodes (1) and each tree size, every batch size whose
        rows fit a step (batch 1 always); then one request's prefill chunks (1, n)."""
        tokens = (1, *self.tree_sizes)
        rows_cap = max(self.max_num_batched_tokens, max(tokens))
        shaped = tuple((b, n) for n in tokens for b in self.graph_batch_sizes
                       if b * n <= rows_cap or b == 1)  # fmt: skip
        return shaped + tuple((1, n) for n in self.prefill_graph_sizes)

    @functools.cached_property
    def capacity_tokens(self) -> int:
        """KV slots in the pool (num_pages * page_size)."""
        return self._need("num_pages") * self.page_size

    def to_json(self) -> dict:
        """The knobs and the derived sizes as JSON values (for /server_info)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.device, torch.dtype)):
                v = str(v).removeprefix("torch.")
            elif isinstance(v, Mapping):
                v = {str(k): x for k, x in v.items()}
            out[f.name] = v
        out["derived"] = {
            "max_budget": self.max_budget,
            "adaptive": self.adaptive,
            "budget_buckets": list(self.budget_buckets),
            "spec_budgets": list(self.spec_budgets),
            "tree_sizes": list(self.tree_sizes) if self._sized_trees else None,
            "max_forward_tokens": self.max_forward_tokens,
            "max_chunk": self.max_chunk,
            "prefill_graph_sizes": list(self.prefill_graph_sizes) if self._sized_trees else None,
            "graph_batch_sizes": list(self.graph_batch_sizes),
            "round_lookahead": self.lookahead,
            "decode_lookahead": self.plain_lookahead,
            "capacity_tokens": self.capacity_tokens if self.num_pages is not None else None,
        }
        return out

    @property
    def _sized_trees(self) -> bool:
        depth = self.speculative_num_draft_tokens
        return self.speculative_algorithm != "CHAIN" or depth is not None
