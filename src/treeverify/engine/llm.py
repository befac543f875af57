"""`LLM`: the step loop that ties scheduler, block manager, KV cache, model and sampler.

    llm = LLM("tiny-llama")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))

One step: `batch = scheduler.schedule()`, the speculating sequences' trees drafted (`tb`), one
forward `runner.run(batch, tb)` over everything the step mixes, tokens sampled or accepted,
`scheduler.postprocess(batch, tokens, kv_ahead)`. A step of greedy rounds with a DFlash drafter
(or the n-gram one, `ngram_whole_rounds`) is one whole-round replay instead
(engine/round_graphs.py; eager on the CPU), prefill chunks
beside it in their own forward; with `decode_lookahead`, a step of plain greedy decodes is launched
before the previous one is read (engine/decode_ahead.py). Attention goes through `PagedAttention`: a
`TreeAttentionPlan` over the paged cache. Every knob is an `EngineConfig` (`llm.config`).
The server and the benchmarks use the facade (`add_request`, `step`, `abort`, `has_unfinished`,
`output`, and engine/introspection.py's reports), never the parts.

Startup on a GPU: load the weights; size the KV pool from `mem_fraction_static` (unless
`num_pages` is given) and allocate it; a warmup forward; capture CUDA graphs of the decode step
(and of the speculative verify step) per batch bucket up to `cuda_graph_max_bs` unless
`disable_cuda_graph`. `startup` holds each phase's seconds and what was decided. On the CPU the
engine is eager with `num_pages` pages (default 512).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from treeverify import env
from treeverify.engine import faults
from treeverify.engine.block_manager import BlockManager
from treeverify.engine.budget_calibration import calibrate, make_controller
from treeverify.engine.budget_controller import FAST, GREEDY, SAMPLED
from treeverify.engine.config import EngineConfig
from treeverify.engine.decode_ahead import DecodeAhead
from treeverify.engine.drafter_feed import DrafterFeed
from treeverify.engine.drafters import DFlashSource, default_depth, make_source, resolve_drafter
from treeverify.engine.introspection import Introspection
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.logits_processor import LogitsProcessor
from treeverify.engine.memory import check_given_pool, check_headroom, size_kv_pool
from treeverify.engine.model_runner import ModelRunner
from treeverify.engine.ring_put import graphs_write_ring
from treeverify.engine.round_graphs import RoundGraphs
from treeverify.engine.sampler import TokenLogprobs, sample, token_logprobs
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.scheduler import ScheduledBatch, Scheduler
from treeverify.engine.sequence import Sequence
from treeverify.engine.spec_step import SpeculativeSteps
from treeverify.engine.speculative import SpeculativeDecoder
from treeverify.models import fused_routing, gemv, pdl
from treeverify.models.moe import DeepseekMoE, Router

log = logging.getLogger("treeverify.engine")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: one per prompt token, the first with logprob None
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM(SpeculativeSteps, DrafterFeed, Introspection):
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **knobs) -> None:  # fmt: skip
        """`LLM("tiny-llama", speculative_algorithm="DDTREE", ...)` or `LLM(config=cfg)`: every
        knob is an `EngineConfig` field (same names and defaults); knobs given with a config
        override its values (`speculative_algorithm=None` over a speculative config turns
        speculation off, its speculative knobs reset). Bad values: ValueError naming the knob,
        before anything loads."""
        from treeverify.models import load_model

        if unknown := sorted(set(knobs) - {f.name for f in dataclasses.fields(EngineConfig)}):
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
        if model is not None:
            knobs["model"] = model
        # (EngineConfig refuses speculative knobs set without speculative_algorithm)
        if (
            config is not None
            and "speculative_algorithm" in knobs
            and (knobs["speculative_algorithm"] is None)
        ):  # speculation turned off over a config that has it: its knobs go with it
            for f in dataclasses.fields(EngineConfig):
                if f.name.startswith("speculative_") and f.name not in knobs:
                    knobs[f.name] = f.default
        config = EngineConfig(**knobs) if config is None else dataclasses.replace(config, **knobs)
        self.config = config  # resolved below: num_pages (GPU sizing), draft depth (drafter)
        if config.device.type == "cuda" and not torch.cuda.is_available():  # (a config may
            # describe a GPU engine anywhere; building one needs the GPU)
            raise ValueError(f"device: {str(config.device)!r}, but this torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use device='cpu'")  # fmt: skip
        dtype, on_gpu = config.dtype, config.on_gpu
        self.startup: dict = {}
        t0 = time.perf_counter()
        self.model_config, self.model, self.tokenizer = load_model(
            config.model, dtype=dtype, device=config.device, seed=config.seed)  # fmt: skip
        self.model.eval().fuse_for_inference()
        t0 = self._phase("load", t0)
        # Penalty / logit_bias tables (one row per running request), before the KV pool sizing.
        self.processor = LogitsProcessor(config.max_num_seqs, self.vocab_size, self.device)
        spec = self.model.kv_cache_spec()
        if config.num_pages is None:  # a GPU: what fits in mem_fraction_static
            sizing = size_kv_pool(spec, dtype, config.page_size, config.mem_fraction_static,
                                  self.device)  # fmt: skip
            self.config = config = config.resolved(num_pages=sizing.num_pages)
            self.startup["kv"] = sizing.describe()
        num_pages, page_size = config.num_pages, config.page_size
        if "kv" not in self.startup:  # given, not sized: it must fit before it is allocated
            check_given_pool(spec, dtype, num_pages, page_size, self.device)
        self.block_manager = BlockManager(num_pages, page_size)
        self.cache = KVCache(num_pages, page_size, self.device, spec=spec, dtype=dtype)
        self.startup.setdefault(
            "kv",
            f"KV cache: {config.capacity_tokens} tokens, {self.cache.bytes / 1024**3:.3f} GiB "
            f"({num_pages} pages, given)",
        )
        log.info("%s", self.startup["kv"])
        if self.device.type == "cuda":
            self.startup["decode_gemv"] = gemv.describe()
            log.info("%s", self.startup["decode_gemv"])
            self.startup["pdl"] = pdl.describe()
            log.info("%s", self.startup["pdl"])
            if routers := [m for m in self.model.modules() if isinstance(m, Router)]:
                self.startup["moe_routing"] = fused_routing.describe(all(r.fused for r in routers))
                log.info("%s", self.startup["moe_routing"])
            if moes := [m for m in self.model.modules() if isinstance(m, DeepseekMoE)]:
                self.startup["moe_experts"] = moes[0].describe()
                log.info("%s", self.startup["moe_experts"])
        t0 = self._phase("kv_alloc", t0)
        # Every EOS id: the tokenizer's, config.json's and generation_config.json's (int or list).
        eos = getattr(self.tokenizer, "eos_token_ids", None) or [
            getattr(self.tokenizer, "eos_token_id", None)
        ]
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill_size=config.chunked_prefill_size,
            eos_token_ids=[e for e in eos if e is not None],
            detokenize=self.tokenizer.decode,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.cache, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_forward_tokens, max_chunk=config.max_chunk,
            attention_backend=config.attention_backend,
            max_context=self.model_config.max_position_embeddings,
        )  # fmt: skip
        self.spec = None
        if config.speculating:
            path = config.speculative_draft_model_path
            drafter = resolve_drafter(path, config.model)
            source = make_source(drafter, self.model, self.model_config, dtype, self.device)
            if path is None:
                log.info("speculative drafter: %s (%s)", drafter, "the model's own"
                         if drafter != "ngram" else "the model ships none")  # fmt: skip
            if config.speculative_num_draft_tokens is None:
                self.config = config = config.resolved(
                    speculative_num_draft_tokens=default_depth(source))  # fmt: skip
            block = getattr(getattr(source, "drafter", None), "block_size", None)  # DFlash's
            if block is not None and not 1 <= config.speculative_num_draft_tokens < block:
                raise ValueError(f"speculative_num_draft_tokens: expected 1..{block - 1} for "
                                 f"this DFlash drafter (block size {block}), got "
                                 f"{config.speculative_num_draft_tokens}")  # fmt: skip
            self.model.capture_layers = frozenset(source.target_layer_ids)
            self.spec = SpeculativeDecoder(
                self.block_manager, self.cache, self.vocab_size,
                algorithm=config.speculative_algorithm, budget=config.speculative_ddtree_budget,
                depth=config.speculative_num_draft_tokens, source=source,
                processor=self.processor,
            )  # fmt: skip
        self.controller = make_controller(config)
        self.rounds: RoundGraphs | None = None  # whole greedy rounds, once made
        self.ahead: DecodeAhead | None = None  # plain greedy steps launched ahead, once made
        self._step_budget: int | None = None  # the last step's budget when it was decode-only
        # (request ids, budget) the controller chose during the last step for this one: with
        # rounds launched ahead the choice is made when the next round is launched (below)
        self._planned: tuple[tuple[str, ...], int] | None = None
        self.last_budget: int | None = None  # the last step's budget for its speculating ones
        # whether the last step ran at its budget's steady cost: False for a whole round read
        # first, or one launched ahead and taken without launching the next (a budget switch)
        self._step_steady = True
        self._step_path = FAST  # the step path of the controller's last choice (its costs')
        # a steady step's cost taught to the controller: the whole engine step (schedule, run,
        # postprocess: what calibration times and what the loop's period is) or, by default
        # until measured on a GPU, `run_batch` alone (TREEVERIFY_COST_WHOLE_STEP)
        self._cost_whole_step = env.cost_whole_step()
        # the span the last step taught (or would have): what calibration times with
        # TREEVERIFY_CALIBRATE_RUN_BATCH, so calibrated and live entries share one unit
        self.calibrate_taught_span = env.calibrate_run_batch()
        self.taught_seconds: float | None = None
        self._logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self._next_id = 0
        self.planted_fault = faults.install(self)  # TEST ONLY; None unless TREEVERIFY_FAULT
        self.warmup()
        t0 = self._phase("warmup", t0)
        self.cuda_graph_buckets: list[tuple[int, int]] = []
        buckets = list(config.graph_buckets)
        if on_gpu:  # decode steps plan per bucket, graphs or not: the same split-KV layout
            self.runner.plan_batch_sizes = list(config.graph_batch_sizes)
            self.runner.prefill_sizes = list(config.prefill_graph_sizes)  # and short prefills
        if on_gpu and config.disable_cuda_graph:
            self.runner.prepare_plans(buckets)
        if on_gpu and not config.disable_cuda_graph:
            self.cuda_graph_buckets = buckets
            self.startup["graphs"] = self.runner.capture_graphs(self.cuda_graph_buckets)
            if self.spec is not None:  # the round's draft (DFlash), build, accept per bucket
                bs, budgets = list(config.graph_batch_sizes), list(config.spec_budgets)
                self.spec.capture(bs, self.device, budgets)
                if isinstance(source := self.spec.source, DFlashSource):  # contexts <= max ctx
                    ctx = min(config.capacity_tokens, self.runner.max_context)
                    depths = [self.spec.draft_depth(b) for b in budgets]
                    self.startup["draft_graphs"] = source.capture(
                        bs, depths, ctx, self.device, max_requests=config.max_num_seqs + 1
                    )
                elif config.ngram_whole_rounds:  # their rings at fixed addresses
                    source.capture(config.max_num_seqs + 1, self.device)
            self._make_round_graphs(capture=True)
            self._make_decode_ahead(capture=True)
            t0 = self._phase("capture", t0)
        elif on_gpu:
            log.info("CUDA graphs: disabled (--disable-cuda-graph); every step runs eagerly")
        if not on_gpu:  # the whole-round body, eagerly: the same round as a GPU's replay
            self._make_round_graphs(capture=False)
            self._make_decode_ahead(capture=False)
        if self.controller is not None:
            calibrate(self)
            t0 = self._phase("calibrate", t0)
        if on_gpu:
            self.startup["memory"] = check_headroom(self.device)

    def _make_round_graphs(self, capture: bool) -> None:
        """Whole greedy rounds per (batch bucket, budget) for a DFlash drafter, and for the
        n-gram one where `ngram_whole_rounds` (unless disable_round_graphs): captured on a GPU, over
        the verify buckets' stages; on the CPU the same body over stages made for it, run
        eagerly."""
        cfg = self.config
        if self.spec is None or cfg.disable_round_graphs:
            return
        if not isinstance(self.spec.source, DFlashSource) and not cfg.ngram_whole_rounds:
            return
        graphs = self.runner.graphs
        if graphs is None:  # the CPU: stages (and bucket-sized plans, made on first use)
            buckets = [(b, self.spec.nodes_for(u)) for b in cfg.graph_batch_sizes
                       for u in cfg.spec_budgets]  # fmt: skip
            graphs = self.runner.staged_buckets(buckets)
        self.rounds = RoundGraphs(graphs, self.spec, self.spec.source.context,
                                  list(cfg.graph_batch_sizes), list(cfg.spec_budgets),
                                  capture=capture, lookahead=cfg.lookahead,
                                  moe_impl=self.runner._moe_impl)  # fmt: skip
        if capture:
            self.startup["round_graphs"] = self.rounds.report

    def _make_decode_ahead(self, capture: bool) -> None:
        """Plain greedy decode steps launched ahead per batch bucket (`plain_lookahead`):
        captured on a GPU over the decode buckets' stages, eagerly on the CPU over its own."""
        cfg = self.config
        if not cfg.plain_lookahead:
            return
        graphs = self.runner.graphs
        if graphs is None:
            buckets = [(b, 1) for b in cfg.graph_batch_sizes]
            graphs = self.runner.staged_buckets(buckets)
        source = None if self.spec is None else self.spec.source
        sizes = DecodeAhead.sizes_made(graphs, cfg.graph_batch_sizes, capture)
        # its plain steps' tapped rows go into the context's feed ring (ids, not copies)
        feed = isinstance(source, DFlashSource) and env.feed_ring() and bool(sizes)
        ring = reserve = None
        if feed:
            source.context.enable_ring(max(sizes))
            if capture and graphs_write_ring():  # written by the step graphs (ring_put)
                ring = source.context.ring_for_graphs(
                    source.drafter.config.context_features, self.config.dtype, self.device
                )
                reserve = source.context.ring_reserve
        self.ahead = DecodeAhead(graphs, self.block_manager, list(cfg.graph_batch_sizes),
                                 capture=capture, moe_impl=self.runner._moe_impl, ring=ring,
                                 reserve=reserve)  # fmt: skip
        if feed:
            self.ahead.sink = source.context.ring_write
            if capture and source.context.ring_projection:  # its rows projected by replays
                self.startup["ring_projection"] = source.context.capture_ring_projection(
                    source.drafter.config.context_features, self.config.dtype, self.device
                )  # engine/ring_projection.py: the gather inside the graph
        if capture:
            self.startup["decode_ahead"] = self.ahead.info

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def attention_backend(self) -> str:
        """The backend attention runs on ("auto" resolved: cuda on a GPU, torch on the CPU)."""
        return self.config.attention_backend

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def capacity_tokens(self) -> int:
        """KV slots in the pool: the longest prompt + max_tokens one request can have."""
        return self.config.capacity_tokens

    def _phase(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.startup[f"{name}_seconds"] = round(now - t0, 3)
        return now

    def warmup(self) -> None:
        """Two short requests end to end (prefill + a decode step), one greedy and one sampled:
        loads kernels (a GPU's sampling kernel is compiled here, not on the first sampled
        request), allocates the eager plans, and fails here rather than on the first real one."""
        self.generate([[0, 1, 2]] * 2, [
            SamplingParams(temperature=0, max_tokens=2, speculative=False),
            SamplingParams(temperature=1.0, seed=0, max_tokens=2, speculative=False),
        ])  # fmt: skip
        if self.spec is not None:
            self.spec.reset_stats()
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:  # fmt: skip
        """Queue one request. ValueError naming the argument for a prompt that is not text or
        token ids of this vocabulary, or that with max_tokens does not fit the model's context;
        nothing is queued then (an out-of-vocabulary id used to fail inside the step and leave
        the engine unable to schedule again)."""
        return self._add(*self._prepare(prompt, params), request_id)

    def _add(self, ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        """Queue a request `_prepare` has checked."""
        rid = request_id if request_id is not None else f"req-{self._next_id}"
        self._next_id += 1
        seq = self.scheduler.add(Sequence(rid, ids, params))
        if self.controller is not None:  # whose engine-wide acceptance it starts from
            self.controller.note_request(rid, SAMPLED if params.temperature > 0 else GREEDY)
        self._logprobs[rid] = []
        if params.prompt_logprobs is not None:  # the first prompt token has no logprob
            self._prompt_logprobs[rid] = [TokenLogprobs(ids[0], None, [])]
        return seq

    def _prepare(self, prompt, params) -> tuple[list[int], SamplingParams]:
        """(token ids, params) of a request, checked (add_request's errors)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except UnicodeError as exc:  # a lone surrogate: no text (the error named no argument)
                raise ValueError(f"prompt: not encodable text ({exc})") from exc
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"prompt: token ids must be ints, got {t!r}")
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids, got "
                             f"{type(prompt).__name__}")  # fmt: skip
        if not ids:
            raise ValueError("prompt: must not be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")  # fmt: skip
        self.check_params(params)
        ctx = self.runner.max_context  # the model's positions
        if len(ids) + params.max_tokens > ctx:
            raise ValueError(f"max_tokens: {params.max_tokens} + the prompt's {len(ids)} tokens "
                             f"exceed the model's context of {ctx} positions")  # fmt: skip
        # the KV pool's bound too (the scheduler's, checked here before anything is queued:
        # generate() left the prompts before a too-long one queued, run by the next call)
        need = len(ids) + params.max_tokens - 1  # the last token never needs KV
        cap = self.scheduler.block_manager.capacity_tokens
        if need > cap:
            raise ValueError(f"max_tokens: {params.max_tokens} + the prompt's {len(ids)} tokens "
                             f"need {need} KV slots; the KV pool holds {cap} (num_pages x "
                             f"page_size)")  # fmt: skip
        return ids, params

    def check_params(self, params: SamplingParams) -> None:
        """What a request may ask of this engine beyond SamplingParams' own checks: logit_bias
        ids in the vocabulary, a speculative_budget among the budgets it captured; SamplingParams'
        own checks again first (a field set after construction). Raises ValueError naming the
        field (the server turns it into a 400)."""
        params.validate()
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # could never match: a typo, surely
            raise ValueError(f"stop_token_ids: token id {max(params.stop_token_ids)} is outside "
                             f"the vocabulary (0..{vocab - 1})")  # fmt: skip
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the "
                             f"vocabulary (0..{vocab - 1})")  # fmt: skip
        if params.speculative_budget is not None:
            budgets = self.config.spec_budgets
            if not budgets:
                raise ValueError("speculative_budget: this engine runs no speculative decoding")
            if params.speculative_budget not in budgets:
                raise ValueError(f"speculative_budget: expected one of {list(budgets)}, got "
                                 f"{params.speculative_budget}")  # fmt: skip

    # ---- the step loop -------------------------------------------------------------------------
    def run_batch(self, batch: ScheduledBatch) -> list[int | list[int]]:
        """One forward for the batch: a token per plain sequence, a round's tokens per
        speculating one; logprobs kept per request."""
        tb = None
        self._step_budget = None
        self._step_steady = True
        self._step_path = FAST  # the controller's step path (spec_step.py's _cost_path)
        self.last_budget = None  # this step's budget for its speculating requests, if any
        if self.spec is not None:  # (a step with rounds discards a plain step launched ahead)
            out, tb = self._speculative_step(batch)  # engine/spec_step.py
            if out is not None:
                return out
        if tb is None and (out := self._plain_ahead(batch)) is not None:
            return out
        if self.ahead is not None:
            self.ahead.discard()  # not a plain greedy step: the one launched ahead is moot
        if tb is not None and len(tb.seqs) == len(batch.chunks):
            out = self._run_round(batch, tb)
            self._observe_paths(tb)
            return out
        return self._forward(batch, tb)

    def _plain_ahead(self, batch: ScheduledBatch) -> list[int] | None:
        """A step's plain greedy decodes through engine/decode_ahead.py (the next step launched
        before this one is read) when the step allows it: greedy, no logprobs, penalties or
        logit_bias; else None. A DFlash drafter gets the step's hidden rows. Prefill chunks in
        the same step (an arrival) run their own forward after it, so the step launched ahead
        for the decodes is still taken; the next is launched only if no prefill completes now
        and no request may be admitted next step (either changes the next step's batch)."""
        ahead, chunks = self.ahead, batch.decodes
        if ahead is None or not chunks:
            return None
        seqs = [c.seq for c in chunks]
        if not self._device_picks(seqs) or not ahead.takes(seqs):  # engine/spec_step.py
            return None
        go_on = not self.scheduler.may_admit() and not any(c.samples for c in batch.prefills)
        if go_on and self.controller is not None:  # the next step's budget, chosen now
            want = [s for s in seqs if self.spec.wants(s)]
            go_on = not want or self._plan_next(want) == 0
        tokens = ahead.step(chunks, ahead=go_on)
        if tokens is None:
            return None
        self._step_steady = ahead.steady
        for seq in seqs:
            self._logprobs[seq.request_id].append(None)
        if ahead.hidden is not None and self.spec is not None:  # (n, F), the chunks' order
            self._observe_ahead(chunks, ahead.hidden)  # engine/drafter_feed.py
        elif ahead.hidden_ids is not None and self.spec is not None:  # in the feed ring
            self._observe_ring(chunks, ahead.hidden_ids)
        if batch.prefills:  # the step's sampled order: decodes, then prefills
            return tokens + self._forward(ScheduledBatch(prefills=batch.prefills), None)
        return tokens

    def _forward(self, batch: ScheduledBatch, tb) -> list[int | list[int]]:
        """One forward over whatever the batch mixes (prefill chunks, plain decodes, the trees of
        `tb` each in its sequence's place): plain rows sampled, trees accepted."""
        trees = {s.request_id: tb.nodes for s in tb.seqs} if tb is not None else {}
        t0 = time.perf_counter()
        want_prompt = {}  # request id -> first prompt position whose row it still needs
        for c in batch.prefills:
            lps = self._prompt_logprobs.get(c.seq.request_id)
            if lps is not None and len(lps) < c.seq.num_prompt_tokens:
                want_prompt[c.seq.request_id] = len(lps) - 1
        rows = self.runner.run(batch, tb, want_prompt).per_sequence()  # each (1 or N, V)
        if want_prompt:
            self._keep_prompt_logprobs(batch)
        if trees:  # the round's verify phase is this step's forward
            self.spec.stats.phase_seconds["verify"] += time.perf_counter() - t0
        plain = [i for i, s in enumerate(batch.sampled) if s.request_id not in trees]
        out: list[int | list[int]] = [0] * len(rows)
        if plain:
            toks, infos = self._sample(torch.cat([rows[i] for i in plain]),
                                       [batch.sampled[i] for i in plain])  # fmt: skip
            for i, tok, info in zip(plain, toks, infos, strict=True):
                out[i] = tok
                self._logprobs[batch.sampled[i].request_id].append(info)
        paths = {}
        if tb is not None:  # the same batched acceptance as a whole-step round
            at = {s.request_id: i for i, s in enumerate(batch.sampled)}
            logits = torch.cat([rows[at[s.request_id]] for s in tb.seqs])  # (B*N, V)
            for seq, toks, path in zip(tb.seqs, self.spec.accept_batch(tb, logits), tb.paths,
                                       strict=True):  # fmt: skip
                out[at[seq.request_id]] = toks
                paths[seq.request_id] = path
            self._keep_round_logprobs(tb)
        if self.spec is not None and self.runner.hidden is not None:
            self._observe(batch.chunks, trees, paths, self.runner.hidden)
        if tb is not None:
            self._observe_paths(tb)
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Plain decoding's tokens for (N, V) rows, after penalties / logit_bias if any asks."""
        if self.processor.needed(seqs):
            rows = self.processor.rows(seqs)
            logits = self.processor.apply(logits[:, None, :], rows)[:, 0]  # (N, V)
        return sample(logits, seqs)

    def _keep_prompt_logprobs(self, batch: ScheduledBatch) -> None:
        """Prompt tokens' logprobs from this step's prefill rows: the model's own distribution
        (no penalties, no logit_bias), position p's row for prompt token p + 1."""
        seqs = {c.seq.request_id: c.seq for c in batch.prefills}
        for rid, (first, logits) in self.runner.prompt_logits.items():
            seq = seqs[rid]
            targets = seq.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
            self._prompt_logprobs[rid].extend(
                token_logprobs(logits, targets, seq.sampling_params.prompt_logprobs)
            )

    def step(self) -> list[Sequence]:
        clock = self.controller.clock if self.controller is not None else time.perf_counter
        t_step = clock()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        t0 = clock()
        tokens = self.run_batch(batch)
        wall = clock() - t0
        # a round's accepted nodes (all its tokens but the bonus) have their K/V in place
        ahead = [len(t) - 1 if isinstance(t, list) else 0 for t in tokens]
        finished = self.scheduler.postprocess(batch, tokens, ahead)
        self.processor.commit()  # count the committed tokens; free finished requests' rows
        if self.controller is not None:
            if self._cost_whole_step:  # as calibration times a step (engine/budget_calibration)
                wall = clock() - t_step
            self.taught_seconds = wall
            if self._step_budget is not None and self._step_steady:
                # a decode-only step at its budget's steady cost (a switch's steps would teach
                # the controller a read-first round's cost, or a taken round's remainder)
                self.controller.observe_step(len(batch.decodes), self._step_budget, wall,
                                             self._step_path)  # fmt: skip
            # every step, steady or not: what leaving plain decoding for one round costs
            # (`_step_budget`: None unless every decode ran at one budget, no prefill beside)
            self.controller.observe_wall(len(batch.decodes), self._step_budget, wall)
        if self.spec is not None:
            for seq in finished:
                self.spec.source.forget(seq.request_id)
                if self.controller is not None:
                    self.controller.forget(seq.request_id)
        return finished

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (a list of strings or of token-id lists; one string: one prompt) to
        completion with `params` (one for all, or a list, one each). Every prompt is checked
        before any is queued; if a step fails, this call's requests are aborted and the engine
        stays usable."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of prompts (strings or lists of "
                             "token ids)")  # fmt: skip
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise ValueError("prompts: got a list of ints; one tokenized prompt goes in a list "
                             "of its own: generate([[...]])")  # fmt: skip
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} "
                                 f"prompts (one for all, or one each)")  # fmt: skip
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        ready = [self._prepare(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        seqs = [self._add(ids, sp, None) for ids, sp in ready]  # checked once, above
        try:
            while self.has_unfinished():
                self.step()
        except Exception:
            self.recover_after_failed_step()
            for s in seqs:
                self.abort(s.request_id)
            raise
        return [self.output(s) for s in seqs]

    def logprobs_so_far(self, request_id: str) -> list[TokenLogprobs | None]:
        """Logprobs of the tokens a running request has produced so far (for streaming)."""
        return self._logprobs.get(request_id, [])

    def prompt_logprobs(self, request_id: str) -> list[TokenLogprobs] | None:
        """A request's prompt logprobs (complete once its first token or its finish is out)."""
        return self._prompt_logprobs.get(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running (a `step()` has work)."""
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason 'abort': its KV pages freed, its drafter context and
        acceptance history dropped; `output(seq)` still gives what it produced. False when it is
        not in flight (finished already, or unknown)."""
        if not self.scheduler.abort(request_id):
            return False
        if self.spec is not None:
            self.spec.source.forget(request_id)
        if self.controller is not None:
            self.controller.forget(request_id)
        return True

    def recover_after_failed_step(self) -> None:
        """After `step()` raised mid-batch: forget the batch so scheduling can continue."""
        self.scheduler.discard_in_flight()
        if self.rounds is not None:
            self.rounds.discard()
        if self.ahead is not None:
            self.ahead.discard()

    def output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text if seq.output_text is not None else self.tokenizer.decode(
            seq.output_token_ids
        )  # fmt: skip
        n = seq.num_output_tokens
        lps = self._logprobs.pop(seq.request_id, [])[:n]  # a stop cuts a round
        lps += [None] * (n - len(lps))  # one entry per token (rounds without logprobs add none)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             text, seq.finish_reason, lps,
                             self._prompt_logprobs.pop(seq.request_id, None))  # fmt: skip
