"""The engine: `step()` is schedule → execute → update. No sockets, no threads: the process loop
(worker/main.py) or a test drives it directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from steadfast.config import Config
from steadfast.kv.arena import TORCH_DTYPES, ArenaSpec, KVArena
from steadfast.kv.block_manager import BlockManager, BlockSource
from steadfast.kv.ledger import LedgerError, ReceiverGoneError
from steadfast.model.gguf_loader import LlamaConfig, load_weights, open_gguf, read_config
from steadfast.model.llama import LlamaModel
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.protocol import AddRequest, Handoff, RequestOutput
from steadfast.worker.detokenizer import Detokenizer
from steadfast.worker.ledger_sync import LedgerSync
from steadfast.worker.request import Request, Status
from steadfast.worker.runner import ModelRunner
from steadfast.worker.sampler import sample
from steadfast.worker.scheduler import ScheduledStep, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model_cfg: LlamaConfig
    model: LlamaModel
    tokenizer: GGUFTokenizer
    max_model_len: int


def max_model_len(cfg: Config, model_cfg: LlamaConfig) -> int:
    return min(cfg.model.max_model_len or model_cfg.context_length, model_cfg.context_length)


def arena_spec(cfg: Config, model_cfg: LlamaConfig) -> ArenaSpec:
    c = cfg.cache
    if c.num_blocks:
        return ArenaSpec(
            c.num_blocks,
            model_cfg.num_layers,
            c.block_size,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            cfg.model.dtype,
        )
    return ArenaSpec.for_memory(
        c.kv_memory_mb << 20,
        model_cfg.num_layers,
        c.block_size,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
        cfg.model.dtype,
    )


def load_model(cfg: Config) -> LoadedModel:
    reader = open_gguf(cfg.model.resolved_path)
    model_cfg = read_config(reader)
    limit = max_model_len(cfg, model_cfg)
    weights = load_weights(reader, model_cfg, TORCH_DTYPES[cfg.model.dtype])
    device = cfg.model.resolved_device
    if device != "cpu":
        weights = {name: w.to(device) for name, w in weights.items()}
    model = LlamaModel(model_cfg, weights, TORCH_DTYPES[cfg.model.dtype], max_positions=limit)
    return LoadedModel(model_cfg, model, GGUFTokenizer.from_gguf(reader), limit)


def private_arena(cfg: Config, model_cfg: LlamaConfig, path: str) -> KVArena:
    """An arena for one engine alone: a /dev/shm file at `path` on the CPU, device memory on a GPU."""
    spec = arena_spec(cfg, model_cfg)
    device = cfg.model.resolved_device
    return KVArena.create(path, spec) if device == "cpu" else KVArena.create_device(spec, device)


class Engine:
    def __init__(
        self,
        cfg: Config,
        loaded: LoadedModel,
        arena: KVArena,
        source: BlockSource | None = None,
        sync: LedgerSync | None = None,
    ) -> None:
        if arena.device.type != loaded.model.device.type:
            raise ValueError(f"the KV arena is on {arena.device}, the model on {loaded.model.device}")
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.arena = arena
        self.blocks = BlockManager(
            arena.spec.num_blocks,
            arena.spec.block_size,
            cfg.cache.enable_prefix_caching,
            source=source,
            grant_batch=cfg.cache.pool_grant_batch,
        )
        self.sync = sync
        self.scheduler = Scheduler(cfg.scheduler, self.blocks)
        self.runner = ModelRunner(loaded.model, arena, self.blocks, cfg.scheduler.decode_attention_groups)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside a step (rejections)
        self._handoffs: list[tuple[Request, RequestOutput]] = []  # prompts done, KV to hand over
        self.steps = 0
        self.step_seconds = 0.0
        self.step_tokens = 0
        self.generated_tokens = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    def add_request(self, msg: AddRequest) -> None:
        if msg.request_id in self.requests:
            self._reject(msg, f"request id {msg.request_id} is already in flight")
            return
        total = len(msg.prompt_ids) + msg.params.max_tokens
        if not msg.prompt_ids or len(msg.prompt_ids) >= self.max_model_len:
            self._reject(
                msg, f"prompt of {len(msg.prompt_ids)} tokens does not fit the context of {self.max_model_len}"
            )
            return
        if self.blocks.blocks_needed(min(total, self.max_model_len)) > self.blocks.num_blocks:
            self._reject(msg, f"request needs more KV blocks than this worker has ({self.blocks.num_blocks})")
            return
        request = Request(msg.request_id, msg.prompt_ids, msg.params, msg.priority)
        request.decode_worker = msg.decode_worker
        detok = Detokenizer(self.tokenizer, msg.prompt_ids, msg.params.stop)
        if msg.handoff is not None:
            self._receive(request, detok, msg)
            return
        if msg.resume is not None:
            if not self._resume(request, detok, msg):
                return
        self.requests[msg.request_id] = request
        self._detok[msg.request_id] = detok
        self.scheduler.add(request)

    def _receive(self, request: Request, detok: Detokenizer, msg: AddRequest) -> None:
        """Continue a request whose prompt a prefill worker of this node computed: its KV blocks are
        ours already (handed over in the ledger), the first token is in `resume`."""
        assert msg.handoff is not None and msg.resume is not None
        h = msg.handoff
        request.output_ids = list(msg.resume.output_ids)
        for token in request.output_ids:
            detok.add(token)
        detok.sent = msg.resume.text_chars
        if self.sync is not None:
            self.sync.received(h.sealed)
        self.blocks.receive(request.request_id, request.all_ids, h.block_ids, h.num_computed, set(h.sealed))
        request.num_computed = h.num_computed
        self.requests[msg.request_id] = request
        self._detok[msg.request_id] = detok
        self.scheduler.add_running(request)

    def _resume(self, request: Request, detok: Detokenizer, msg: AddRequest) -> bool:
        """Continue a request a dead worker was serving, from what its client already has."""
        assert msg.resume is not None
        done = msg.resume.output_ids
        if len(done) >= msg.params.max_tokens or len(msg.prompt_ids) + len(done) >= self.max_model_len:
            self._reject(msg, f"request {msg.request_id} was already complete when its worker died")
            return False
        t0 = time.perf_counter()
        request.output_ids = list(done)
        for token in done:  # the text state as the client saw it: stop-string holdback included
            detok.add(token)
        # Not clamped: a client holding more text than `done` spells gets none of it again.
        detok.sent = msg.resume.text_chars
        request.recovery = self._recover(request)
        request.resume_tokens = request.num_tokens
        log.info(
            "took over %s from worker %d at token %d: %s, %d tokens of KV adopted (%.0f ms)",
            request.request_id,
            msg.resume.from_worker,
            len(done),
            request.recovery[0],
            request.recovery[1],
            1000 * (time.perf_counter() - t0),
        )
        return True

    def _recover(self, request: Request) -> tuple[str, int]:
        """Pick the takeover route; return it and how many tokens of KV were adopted.

        ledger_first adopts the dead worker's sealed, hash-verified blocks and recomputes only the tail;
        rebuild recomputes prompt and delivered tokens. auto adopts whenever anything verifies (hashing
        a block costs far less than recomputing it). Any disagreement between ledger and arena means
        rebuild: suspect bytes are never adopted.
        """
        mode = self.cfg.fault_recovery.kv_cache.recovery_mode
        if self.sync is None or mode == "rebuild":
            return "rebuild", 0
        bs = self.blocks.block_size
        ids = request.all_ids
        names = self.blocks.chain(ids, (len(ids) - 1) // bs)
        # Blocks whose content this worker already caches need no adoption.
        plan = self.sync.adoptable(names, lambda pos: self.blocks.is_cached(names[pos]))
        if not plan:
            return "rebuild", 0
        try:
            self.sync.adopt([(b, h) for _, b, h in plan])
        except LedgerError as exc:  # taken by someone else meanwhile: recompute rather than share
            log.warning("request %s: adoption refused (%s); rebuilding", request.request_id, exc)
            return "rebuild", 0
        self.blocks.adopt(ids, [(pos, b) for pos, b, _ in plan])
        return "ledger_first", (plan[-1][0] + 1) * bs

    def _reject(self, msg: AddRequest, why: str) -> None:
        if msg.handoff is not None and msg.handoff.block_ids and self.blocks.source is not None:
            self.blocks.source.release(msg.handoff.block_ids)  # handed to us in the ledger: give them back
        self._pending.append(
            RequestOutput(msg.request_id, [], finish_reason="error", error=why, num_prompt_tokens=len(msg.prompt_ids))
        )

    def abort(self, request_id: str) -> None:
        if self.scheduler.remove(request_id) is not None:
            self._finish(self.requests[request_id], "abort")

    def _finish(self, request: Request, reason: str) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        if self.sync is not None:
            self.sync.finished(request)
        self.requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            return outputs
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.before_execute(self.blocks)
        logits, samplers = self.runner.execute(scheduled)
        prompt_done = self._advance(scheduled)
        tokens = sample(logits, [r.params for r in samplers], [len(r.output_ids) for r in samplers])
        for request, token in zip(samplers, tokens, strict=True):
            outputs.append(self._append(request, token))
        self.steps += 1
        if self.sync is not None:
            self.sync.after_step(self.requests.values(), self.blocks, prompt_done)
        while self._handoffs:  # after the step's seals and checkpoint: what is handed over is recorded
            self._hand_off(*self._handoffs.pop())
        self.step_tokens += scheduled.num_tokens
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def _advance(self, scheduled: ScheduledStep) -> bool:
        """Count the computed KV; True if some request's prefill is now complete."""
        for request in scheduled.decodes:
            request.num_computed += 1
            self.blocks.commit(request.request_id, request.all_ids, request.num_computed)
        prompt_done = False
        for request, n in scheduled.prefills:
            request.num_computed += n
            self.blocks.commit(request.request_id, request.all_ids, request.num_computed)
            prompt_done |= request.num_computed == request.num_tokens
        return prompt_done

    def _append(self, request: Request, token: int) -> RequestOutput:
        request.output_ids.append(token)
        self.generated_tokens += 1
        p = request.params
        detok = self._detok[request.request_id]
        reason = None
        if detok.add(token):
            reason = "stop"
        elif (not p.ignore_eos and token in self.tokenizer.info.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(request.output_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            reason = "length"
        text = detok.take(final=reason is not None)
        out = RequestOutput(
            request.request_id,
            [token],
            text,
            reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=request.num_cached,
            index=len(request.output_ids) - 1,
        )
        if request.recovery is not None:  # the first token after a takeover reports what it cost
            out.route, out.adopted_tokens = request.recovery
            out.recomputed_tokens = request.resume_tokens - request.num_cached
            request.recovery = None
        if reason is not None:
            self.scheduler.remove(request.request_id)
            self._finish(request, reason)
        elif request.decode_worker >= 0 and len(request.output_ids) == 1:
            self._handoffs.append((request, out))
        return out

    def _hand_off(self, request: Request, out: RequestOutput) -> None:
        """Give a prefilled request's KV to its decode worker: ownership changes in the ledger, no
        byte moves (blocks another request here shares are copied). If that cannot be done, this
        worker keeps decoding the request itself: slower for the others, lossless for the client."""
        to = request.decode_worker
        sync = self.sync
        if sync is None:
            out.handoff = Handoff(to, error="no ledger on this worker: KV cannot change owner")
            return
        sealed: list[int] = []
        copied = 0
        t0 = time.perf_counter()

        def transfer(block_ids: list[int], copies: list[tuple[int, bytes]]) -> None:
            nonlocal copied
            sealed.extend(sync.hand_over(block_ids, copies, f"worker{to}", request.request_id))
            copied = len(copies)

        try:
            handed = self.blocks.hand_over(request.request_id, self.arena.copy_block, transfer)
        except ReceiverGoneError as exc:
            handed, why = None, str(exc)
        else:
            why = "no free block to copy a shared prefix block into"
        if handed is None:
            log.warning("request %s: KV not handed to worker %d (%s); decoding it here", request.request_id, to, why)
            out.handoff = Handoff(to, error=why)
            return
        self.scheduler.detach(request)
        request.status = Status.FINISHED
        self.requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)
        out.handoff = Handoff(to, handed, sealed, request.num_computed, copied=copied, seconds=time.perf_counter() - t0)

    def generate(self, requests: list[AddRequest]) -> dict[str, list[RequestOutput]]:
        """Run requests to completion in this process (tests, `steadfast generate`)."""
        for r in requests:
            self.add_request(r)
        results: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        t0 = time.perf_counter()
        while self.has_work:
            for out in self.step():
                results[out.request_id].append(out)
        log.debug("generate: %d steps in %.2fs", self.steps, time.perf_counter() - t0)
        return results
