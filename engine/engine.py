"""`Engine.step(batch)`: one forward pass for a batch of sequences over a shared paged KV cache
(`submit` and `collect`, its two halves, let a caller queue the next step before this one ends)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine import cpu_kernels
from engine.attention import build_metadata
from engine.batch import FROM_LAST_STEP, SeqInput, SeqOutput
from engine.config import ModelConfig
from engine.errors import InvalidRequest
from engine.guided import Guides
from engine.kv_cache import KVCache, pool_dtype
from engine.loader import LoadedModel, load_model
from engine.memory import activation_reserve, check_kv_pool_fits
from engine.native_decode import NativeDecoder
from engine.piecewise_graphs import PiecewiseGraphs
from engine.prompt_scores import PromptScorer, scores_prompt
from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step_checks import StepChecks
from engine.submitted import Fill, LastStep, Submitted
from engine.tensor_parallel import SINGLE, TensorParallel, rank_device
from engine.tokenizer import load_tokenizer
from engine.upload import to_device
from engine.warm_up import representative_batches, warm_up_batches

if TYPE_CHECKING:  # imports Triton: only on CUDA
    from engine.cuda_graphs import GraphOutputs, StepAhead

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidRequest("dtype", f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise InvalidRequest("device", f"unknown device {name!r}; choose cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequest("device", "CUDA was asked for but no CUDA device is available")
    return torch.device(name)


class Followers(Protocol):
    """The other ranks of a tensor-parallel group, as rank 0's engine drives them
    (engine/rank_group.py): every step and release goes to them before rank 0 runs it."""

    def send_step(self, batch: Sequence[SeqInput]) -> None: ...

    def send_release(self, seq_ids: list[Hashable]) -> None: ...

    def check(self, cause: BaseException | None = None) -> None:
        """Raise RankGroupError if the group cannot step: a rank has died, or `cause` (what
        rank 0's step raised) may have left the ranks out of step."""

    def wait_lost(self) -> str:
        """Block until a rank has died; what RankGroupError would say."""

    def close(self) -> None: ...


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        num_kv_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        cuda_graphs: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """kv_cache_dtype: the KV pool's (kv_cache.KV_CACHE_DTYPES); None: the model's."""
        self.loaded = loaded
        self.model = loaded.model
        # The whole model's shape (vocabulary, context); model.config is this rank's slice.
        self.config: ModelConfig = loaded.config
        local = self.model.config
        self.device = next(self.model.buffers()).device
        self.dtype = self.model.norm.weight.dtype
        # Blocks a scheduler may hand out (a reserved dummy block on CUDA is not among them).
        self.num_kv_blocks = num_kv_blocks
        self.max_num_seqs = max_num_seqs
        self.checks = StepChecks(
            self.config.vocab_size, self.config.max_seq_len, num_kv_blocks, block_size
        )
        on_cuda = self.device.type == "cuda"
        # On CUDA one extra block, outside what the scheduler may hand out, takes the writes of
        # padding rows in captured decode graphs.
        total = num_kv_blocks + 1 if on_cuda else num_kv_blocks
        self.kv = KVCache(local, total, block_size, kv_cache_dtype or self.dtype, self.device)
        self.sampler = Sampler()
        self.prompt_scorer = PromptScorer(self.model.logits)
        # Only for sequences whose sampling reads them (penalties, a grammar).
        self._histories: dict[Hashable, list[int]] = {}
        # The matchers of sequences held to a grammar; None: this engine has no tokenizer to
        # follow one with (Engine.from_path gives it the model's).
        self.guides: Guides | None = None
        # Decode attention straight from the pool: Triton on CUDA, native on CPU, else None.
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        self.prefill_kernel: Callable[..., torch.Tensor] | None = None
        self.graphs = None
        # Steps with prompts of up to a few hundred tokens, in graphs around attention (CUDA, one
        # rank: a tensor-parallel rank's collectives are left to eager steps).
        self.piecewise: PiecewiseGraphs | None = None
        # A one-sequence decode step replayed before it was asked for (cuda_graphs.replay_next);
        # `replay_ahead` False turns that off (benchmarks compare the two). Off on a
        # tensor-parallel rank: whether a replay matches the next step depends on the token
        # sampled, and unseeded sampling differs between ranks, whose collectives must not.
        self.replay_ahead = not loaded.tp.sharded
        # On rank 0 of a tensor-parallel group: the other ranks, mirroring every step.
        self.followers: Followers | None = None
        # Greedy rows take the token the graph picked (kernels/greedy.py); False samples them
        # outside the graph like any other row (benchmarks compare the two).
        self.greedy_in_graph = True
        self._ahead: StepAhead | None = None
        # The sampled tokens of the step submitted last, for the next step's FROM_LAST_STEP.
        self._last: LastStep | None = None
        # Seconds each stage of the start took (Engine.from_path fills "load" and "warm_up").
        self.start_times: dict[str, float] = {}
        started = time.perf_counter()
        if on_cuda:
            from engine.cuda_graphs import DecodeGraphs
            from engine.kernels.paged_decode import PagedDecode

            self.decode_kernel = PagedDecode(
                max_num_seqs,
                local.n_heads,
                local.n_kv_heads,
                local.head_dim,
                block_size,
                local.max_seq_len,
                self.device,
                kv_dtype=self.kv.pool.dtype,
            )
            if cuda_graphs:
                self.graphs = DecodeGraphs(
                    self.model, self.kv, num_kv_blocks, max_num_seqs, self.config.vocab_size
                )
                if not loaded.tp.sharded:
                    self.piecewise = PiecewiseGraphs(self.model, self.kv, num_kv_blocks)
        elif cpu_kernels.usable(self.kv.pool) and self.config.head_dim in cpu_kernels.HEAD_DIMS:
            self.decode_kernel = cpu_kernels.PagedDecode(block_size)
            self.prefill_kernel = cpu_kernels.PagedPrefill(block_size)
        fits = NativeDecoder.fits(self.model, self.decode_kernel)
        self.native = NativeDecoder(self.model) if fits else None
        self.start_times["kernels_and_graphs"] = time.perf_counter() - started

    @classmethod
    def from_path(
        cls,
        path: Path,
        device: str = "cpu",
        dtype: str = "float32",
        kv_cache_bytes: int = 1 << 30,
        block_size: int = 16,
        progress: bool = True,
        quantize: str = "auto",
        max_num_seqs: int = 256,
        cuda_graphs: bool = True,
        gpu_memory_fraction: float = 0.9,
        warm_up_tokens: int | None = 2048,
        tp: TensorParallel = SINGLE,
        kv_cache_dtype: str = "auto",
        max_model_len: int = 0,
    ) -> Engine:
        """kv_cache_bytes 0 sizes the KV cache on CUDA from what the weights leave of
        `gpu_memory_fraction` of the card (activations and graphs get a fixed reserve).
        On CUDA the engine is warmed up (`warm_up`) for steps of up to `warm_up_tokens` new
        tokens (the scheduler's step budget); None skips that. With `tp`, this rank's shard
        (on CUDA on the device `device` + rank), with as many KV blocks as every rank has room
        for; a group is started by engine/rank_group.py, which warms it up once all follow.
        max_model_len: the longest sequence (prompt and output) served, at most the model's
        context; 0: the model's."""
        started = time.perf_counter()
        torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
        torch_device = rank_device(torch_device, tp.rank)
        kv_dtype = pool_dtype(kv_cache_dtype, torch_dtype)
        loaded = load_model(path, torch_device, torch_dtype, progress, quantize, tp)
        if max_model_len:
            context = loaded.config.max_seq_len
            if not 1 < max_model_len <= context:
                raise InvalidRequest(
                    "max_model_len",
                    f"must be in [2, {context}] (the model's context), got {max_model_len}",
                )
            loaded.config = replace(loaded.config, max_seq_len=max_model_len)
        load_s = time.perf_counter() - started
        # kv_cache_bytes is each rank's: a rank's blocks hold its KV heads only.
        per_block = KVCache.bytes_per_block(loaded.model.config, block_size, kv_dtype)
        reserve = activation_reserve(
            torch_device, max_num_seqs, warm_up_tokens, loaded.config.vocab_size
        )
        if kv_cache_bytes == 0 and torch_device.type == "cuda":
            fraction = gpu_memory_fraction
            if not 0 < fraction <= 1:
                raise InvalidRequest("gpu_memory_fraction", f"must be in (0, 1], got {fraction}")
            free, total = torch.cuda.mem_get_info(torch_device)
            kv_cache_bytes = int(total * fraction) - (total - free) - reserve
            if kv_cache_bytes < per_block:
                raise InvalidRequest(
                    "gpu_memory_fraction",
                    f"the weights leave no room for a KV cache in {fraction} of the card "
                    f"({free >> 20:,} MiB free, {reserve >> 20:,} MiB kept for activations)",
                )
        max_blocks = -(-loaded.config.max_seq_len // block_size)
        blocks = max(1, min(kv_cache_bytes // per_block, 64 * max_blocks))
        # On a CPU the ranks of a group share the machine's memory; on CUDA each has a device.
        sharing = tp.world_size if torch_device.type == "cpu" else 1
        check_kv_pool_fits(blocks * per_block, reserve, torch_device, sharing)
        blocks = tp.min(blocks)  # block ids mean the same on every rank: one count for all
        engine = cls(loaded, blocks, block_size, max_num_seqs, cuda_graphs, kv_dtype)
        engine.start_times["load"] = load_s
        engine.guides = Guides(lambda: load_tokenizer(path), loaded.config.vocab_size)
        if warm_up_tokens is not None and torch_device.type == "cuda":
            engine.warm_up(warm_up_tokens)
        return engine

    def warm_up(self, max_step_tokens: int = 2048) -> None:
        """Run once every kind of step serving will run (engine/warm_up.py), each compile and
        first use paid now instead of by a request; its seconds go to start_times["warm_up"]."""
        started = time.perf_counter()
        variant = getattr(self.decode_kernel, "variant", lambda b: 0)
        graph_sizes = list(self.graphs.buckets) if self.graphs is not None else []
        batches = warm_up_batches(
            self.config,
            self.block_size,
            self.num_kv_blocks,
            representative_batches(self.max_num_seqs, variant),
            graph_sizes,
            max_step_tokens,
            self.max_num_seqs,
        )
        for batch in batches:
            self.step(batch)
        self._ahead = self._last = None  # of warm-up sequences: never asked for again
        self.release(s.seq_id for batch in batches for s in batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.start_times["warm_up"] = time.perf_counter() - started

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def release(self, seq_ids: Iterable[Hashable]) -> None:
        """Forget per-sequence state of finished sequences (their blocks are the caller's)."""
        ids = list(seq_ids)
        if self.followers is not None:
            self.followers.send_release(ids)
        for seq_id in ids:
            self._histories.pop(seq_id, None)
            self.prompt_scorer.release(seq_id)
            if self.guides is not None:
                self.guides.release(seq_id)

    def check_sampling(self, params: SamplingParams) -> None:
        """InvalidRequest if this engine cannot sample as `params` asks: a grammar it cannot
        compile, or none to compile it with. A grammar is compiled here once, before any step."""
        if not params.grammar:
            return
        if self.guides is None:
            raise InvalidRequest("output_format", "this engine has no tokenizer to follow it")
        self.guides.check(params.grammar)

    def wait_lost(self) -> str | None:
        """Block until a rank of this engine's group dies, and say which (None at once without
        a group): an owner that must not wait for its next step to find out calls this."""
        return None if self.followers is None else self.followers.wait_lost()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do on one process)."""
        followers, self.followers = self.followers, None
        if followers is not None:
            followers.close()

    @torch.inference_mode()
    def forward(
        self,
        batch: Sequence[SeqInput],
        fill: Fill | None = None,
        before_launch: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Write the batch's K/V into the cache and return its final hidden states (T, dim).
        before_launch: called once its inputs are built and on their way, before its kernels."""
        self.checks.validate(batch, fill is not None)
        tokens: list[int] = []
        positions: list[int] = []
        for seq in batch:
            tokens.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
        meta = build_metadata(
            [s.start_pos for s in batch],
            [len(s.token_ids) for s in batch],
            [list(s.block_table) for s in batch],
            self.block_size,
            self.device,
            self.decode_kernel,
            self.prefill_kernel,
        )
        run = self.native if self.native is not None and NativeDecoder.serves(meta) else self.model
        if before_launch is not None:
            before_launch()
        token_ids = to_device(tokens, self.device)
        if fill is not None:
            token_ids.index_copy_(0, fill.at, fill.tokens)
        if self.piecewise is not None and self.piecewise.bucket(len(tokens)) is not None:
            return self.piecewise.run(token_ids, to_device(positions, self.device), meta)
        return run(token_ids, to_device(positions, self.device), meta, self.kv)

    @torch.inference_mode()
    def step(self, batch: Sequence[SeqInput]) -> list[SeqOutput]:
        """One forward for all of `batch`; one output per sequence that asked to sample. On
        rank 0 of a tensor-parallel group every rank runs it; a dead rank raises
        RankGroupError (engine/rank_group.py), now and at every later step."""
        return self.collect(self.submit(batch)) if batch else []

    @torch.inference_mode()
    def submit(
        self, batch: Sequence[SeqInput], before_launch: Callable[[], None] | None = None
    ) -> Submitted:
        """Launch one step; `collect` waits for it and returns its outputs. On CUDA this returns
        once the step is queued on the device, so the caller can prepare and submit the next one
        (whose decodes may take FROM_LAST_STEP) while this one runs. before_launch: called once
        the step's host work is done, before its kernels are queued (not at all where it fails
        first): where a caller that must not be held by a long launch does what cannot wait."""
        followers = self.followers
        if followers is None:
            return self._submit(batch, before_launch)
        if any(FROM_LAST_STEP in s.token_ids for s in batch):
            # Each rank would take its own sample, and unseeded samples differ between ranks.
            raise InvalidRequest("token_ids", "a tensor-parallel group takes no FROM_LAST_STEP")
        followers.send_step(batch)
        try:
            return self._submit(batch, before_launch)
        except Exception as err:
            followers.check(err)  # a dead rank is why: say that instead
            raise

    def _submit(
        self, batch: Sequence[SeqInput], before_launch: Callable[[], None] | None = None
    ) -> Submitted:
        last, self._last = self._last, None
        fill = Fill.of(batch, last, self.device)
        ahead, self._ahead = self._ahead, None
        # A prompt to score needs the hidden states of its rows, which a graph does not keep.
        scoring = any(scores_prompt(s) for s in batch)
        graphed = None if scoring else self._graph_outputs(batch, ahead, fill, before_launch)
        hidden = self.forward(batch, fill, before_launch) if graphed is None else None  # (T, dim)
        scores = self.prompt_scorer.score(batch, hidden) if scoring and hidden is not None else []
        if last is not None and any(
            FROM_LAST_STEP in s.token_ids and s.sampling.needs_history for s in batch
        ):
            # A penalty's or a grammar's history is kept on the host: it needs the token itself.
            # Read once this step is queued behind the one that samples it: the device does not
            # wait for the host meanwhile.
            batch = last.resolved(batch)
        histories = [self._update_history(s) for s in batch]
        sampled = [i for i, s in enumerate(batch) if s.sample]
        if not sampled:
            return Submitted([], torch.empty(0, 2), 0, prompt_scores=scores)
        seqs = [batch[i] for i in sampled]
        if (
            graphed is not None
            and self.greedy_in_graph
            and len(sampled) == len(batch)
            # Plain greedy: each token is the argmax, and only it and its logprob are asked for.
            and all(
                s.sampling.greedy and not s.sampling.adjusts_logits and s.sampling.logprobs == 0
                for s in seqs
            )
        ):
            # The graph already picked every row's token: nothing to sample out here.
            packed, tokens, n_top = graphed.picks, graphed.tokens, 0
        else:
            if graphed is not None:
                logits = graphed.logits
                if len(sampled) < len(batch):  # only the rows that sample
                    logits = logits.index_select(0, to_device(sampled, self.device))
            else:
                assert hidden is not None
                ends = list(itertools.accumulate(len(s.token_ids) for s in batch))
                rows = to_device([ends[i] - 1 for i in sampled], self.device)
                logits = self.model.logits(hidden.index_select(0, rows))  # (S, V)
            sampled_histories = [histories[i] for i in sampled]
            out = self.sampler(
                logits,
                [s.sampling for s in seqs],
                [s.start_pos + len(s.token_ids) for s in seqs],
                sampled_histories,
                [s.prompt_len for s in seqs],
                self._allowed(seqs, sampled_histories, logits.shape[-1]),
            )
            packed, tokens, n_top = out.packed(), out.token_ids, out.n_top
        submitted = Submitted(seqs, packed, n_top, prompt_scores=scores)
        if packed.is_cuda:
            # The step's one host sync (in collect): ids, logprobs and alternatives come back
            # in one transfer.
            submitted.packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            submitted.packed.copy_(packed, non_blocking=True)
            submitted.done = torch.cuda.Event()
            submitted.done.record()
        # One sequence decoding through a graph: replay its next step while the host is busy
        # (queued behind the copy, so that collect's wait does not wait for it too).
        one_row = len(batch) == len(sampled) == 1
        if graphed is not None and self.graphs is not None and self.replay_ahead and one_row:
            tokens = tokens.clone()  # the graph's own buffer: the replay ahead overwrites it
            self._ahead = submitted.ahead = self.graphs.replay_next(batch, tokens)
        # A graph's tokens are static too, but the next step reads them (its fill) before it
        # replays anything.
        self._last = LastStep({s.seq_id: i for i, s in enumerate(seqs)}, tokens, submitted)
        return submitted

    def collect(self, submitted: Submitted) -> list[SeqOutput]:
        """The outputs of a submitted step, a sequence each that sampled; waits for the device."""
        followers = self.followers
        try:
            if submitted.done is not None:
                submitted.done.synchronize()
        except Exception as err:
            if followers is not None:
                followers.check(err)
            raise
        if followers is not None:
            # On NCCL a dead rank's collectives are aborted and return whatever they held.
            followers.check()
        rows = submitted.packed.tolist()
        if submitted.ahead is not None:
            submitted.ahead.tokens = [int(row[0]) for row in rows]
        n_top = submitted.n_top
        outputs = []
        for row, seq in zip(rows, submitted.seqs, strict=True):
            n = min(seq.sampling.logprobs, n_top)
            top = [(int(row[2 + j]), row[2 + n_top + j]) for j in range(n)] if n else []
            outputs.append(SeqOutput(seq.seq_id, int(row[0]), row[1], top))
        return outputs

    def _graph_outputs(
        self,
        batch: Sequence[SeqInput],
        ahead: StepAhead | None,
        fill: Fill | None = None,
        before_launch: Callable[[], None] | None = None,
    ) -> GraphOutputs | None:
        """A decode-only batch replayed through its CUDA graph (or already replayed ahead, if it
        is `ahead`'s step); None where there is no graph for it."""
        graphs = self.graphs
        if graphs is None or graphs.bucket(len(batch)) is None:
            return None
        inputs = self.checks.decode_arrays(batch)
        if inputs is None:
            return None
        if before_launch is not None:
            before_launch()
        if ahead is not None and ahead.matches(batch):
            return ahead.outputs
        return graphs.run(batch, *inputs, fill)

    def _allowed(
        self,
        seqs: Sequence[SeqInput],
        histories: Sequence[tuple[list[int], int] | None],
        vocab: int,
    ) -> tuple[list[int], torch.Tensor] | None:
        """The rows held to a grammar, and the tokens each may take next, for the sampler."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.grammar]
        if not rows:
            return None
        if self.guides is None:
            raise InvalidRequest("output_format", "this engine has no tokenizer to follow it")
        outputs = []
        for i in rows:
            history = histories[i]
            assert history is not None  # kept for every sequence with a grammar
            tokens, prompt_len = history
            outputs.append(tokens[prompt_len:])
        masks = self.guides.masks(
            [seqs[i].seq_id for i in rows], [seqs[i].sampling.grammar for i in rows], outputs
        )
        if self.device.type == "cpu":
            allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            return rows, torch.from_numpy(allowed).bool()
        # Bits cross to the device (32x fewer bytes) and are unpacked there.
        words = to_device(masks, self.device)
        bits = (words[:, :, None] >> torch.arange(32, device=self.device, dtype=torch.int32)) & 1
        return rows, bits.reshape(len(rows), -1)[:, :vocab].bool()

    def _update_history(self, seq: SeqInput) -> tuple[list[int], int] | None:
        if not seq.sampling.needs_history:
            return None
        history = self._histories.get(seq.seq_id)
        if history is None:
            history = list(seq.prefix_ids or ())
            self._histories[seq.seq_id] = history
        if len(history) < seq.start_pos:
            raise InvalidRequest(
                "prefix_ids",
                f"sequence {seq.seq_id} starts at {seq.start_pos} but the engine knows only "
                f"{len(history)} of its earlier tokens",
            )
        del history[seq.start_pos :]
        history.extend(seq.token_ids)
        return history, seq.prompt_len
