"""The engine: `step()` is schedule → execute → update. No sockets, no threads: the process loop
(worker/main.py) or a test drives it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from steadfast.config import Config
from steadfast.kv.arena import TORCH_DTYPES, ArenaSpec, KVArena
from steadfast.kv.block_manager import BlockManager, BlockSource
from steadfast.kv.ledger import LedgerError, ReceiverGoneError
from steadfast.kv.transfer import KVReceiver, KVSender, layer_span, slots_for
from steadfast.model import paged_attention
from steadfast.model.gguf_loader import LlamaConfig, load_weights, open_gguf, read_config
from steadfast.model.llama import LlamaModel
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.protocol import AddRequest, Handoff, RequestOutput, Resume
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
    dtype = TORCH_DTYPES[cfg.model.dtype]
    weights = load_weights(reader, model_cfg, dtype)
    device = cfg.model.resolved_device
    if device != "cpu":
        weights = {name: w.to(device) for name, w in weights.items()}
    paged = None
    if cfg.model.decode_attention == "auto" and paged_attention.supports(
        dtype,
        device,
        model_cfg.num_heads,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
        cfg.cache.block_size,
    ):
        paged = paged_attention.load()
    log.info("decode attention: %s", "in-place kernel" if paged is not None else "torch gather")
    model = LlamaModel(model_cfg, weights, dtype, max_positions=limit, paged=paged)
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
        # Across nodes (set by the worker process): streams KV out (prefill side), takes it in (decode side).
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.layerwise = True  # stream each layer as it is computed, not the whole prompt at the end
        self._sending: dict[str, tuple[int, int]] = {}  # request -> (decode worker, prompt tokens)
        self.steps = 0
        self.step_seconds = 0.0
        self.step_tokens = 0
        self.generated_tokens = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or bool(self._sending)

    @property
    def only_waiting_on_transfers(self) -> bool:
        """Nothing to compute, only KV transfers to hear back from: the loop may sleep a little."""
        return not self.scheduler.has_work and not self._pending and bool(self._sending)

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
            if self._receive(request, detok, msg):
                return
            msg.resume = msg.resume or Resume([], 0)  # the KV did not arrive after all: compute it here
        if msg.kv_paths and msg.decode_worker >= 0 and self.sender is not None and msg.resume is None:
            request.kv_paths = list(msg.kv_paths)
            names = ["primary", *(f"alternate{i}" if i > 1 else "alternate" for i in range(1, len(msg.kv_paths)))]
            self.sender.begin(msg.request_id, list(zip(names, msg.kv_paths, strict=True)), len(msg.prompt_ids))
            self._sending[msg.request_id] = (msg.decode_worker, len(msg.prompt_ids))
        if msg.resume is not None:
            if not self._resume(request, detok, msg):
                return
        self.requests[msg.request_id] = request
        self._detok[msg.request_id] = detok
        self.scheduler.add(request)

    def _receive(self, request: Request, detok: Detokenizer, msg: AddRequest) -> bool:
        """Continue a request whose prompt a prefill worker computed: its KV blocks are ours already
        (handed over in the ledger on this node; written by our receiver from another), the first
        token is in `resume`. False when a transfer's blocks are not there (expired): recompute."""
        assert msg.handoff is not None and msg.resume is not None
        h = msg.handoff
        sealed: list[int] = h.sealed
        if h.path != "same_node":
            claimed = self.receiver.claim(msg.request_id) if self.receiver is not None else None
            if claimed is None or claimed != h.block_ids:
                if claimed and self.blocks.source is not None:
                    self.blocks.source.release(claimed)
                log.warning("request %s: transferred KV not found here; computing the prompt", msg.request_id)
                return False
            sealed = []  # written by our receiver: sealed here as their blocks are named
        request.output_ids = list(msg.resume.output_ids)
        for token in request.output_ids:
            detok.add(token)
        detok.sent = msg.resume.text_chars
        if self.sync is not None:
            self.sync.received(sealed)
        self.blocks.receive(request.request_id, request.all_ids, h.block_ids, h.num_computed, set(sealed))
        request.num_computed = h.num_computed
        # Its first output says where the KV came from ("handoff" on this node, "transfer" from another).
        request.recovery = ("handoff" if h.path == "same_node" else "transfer", h.num_computed)
        request.resume_tokens = request.num_tokens
        self.requests[msg.request_id] = request
        self._detok[msg.request_id] = detok
        self.scheduler.add_running(request)
        return True

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
        if request.request_id in self._sending and self.sender is not None:
            self.sender.abort(request.request_id)  # ended before its KV was committed: the receiver lets go
        self.requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)

    def step(self) -> list[RequestOutput]:
        self._transfer_results()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            return outputs
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.before_execute(self.blocks)
        logits, samplers = self.runner.execute(scheduled, self._layer_streamer(scheduled))
        prompt_done = self._advance(scheduled)
        tokens = sample(logits, [r.params for r in samplers], [len(r.output_ids) for r in samplers])
        for request, token in zip(samplers, tokens, strict=True):
            outputs.append(self._append(request, token))
        self.steps += 1
        if self.sync is not None:
            self.sync.after_step(self.requests.values(), self.blocks, prompt_done)
        while self._handoffs:  # after the step's seals and checkpoint: what is handed over is recorded
            request, out = self._handoffs.pop()
            if request.request_id in self._sending:
                self._send_kv(request, out)
            else:
                self._hand_off(request, out)
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
            # Handed-over KV is not in the prefix-cache count (that is the prefill worker's).
            have = out.adopted_tokens if out.route in ("handoff", "transfer") else request.num_cached
            out.recomputed_tokens = request.resume_tokens - have
            request.recovery = None
        if reason is not None:
            self.scheduler.remove(request.request_id)
            self._finish(request, reason)
        elif request.decode_worker >= 0 and len(request.output_ids) == 1:
            self._handoffs.append((request, out))
        return out

    def _layer_streamer(self, scheduled: ScheduledStep) -> Callable[[int], None] | None:
        """For prefill chunks whose KV goes to another node: a hook the forward pass calls once each
        layer's K/V is in the arena, copying those bytes out to the sender (layer-wise streaming)."""
        sender = self.sender
        spans = [(r, r.num_computed, n) for r, n in scheduled.prefills if r.request_id in self._sending]
        if sender is None or not spans:
            return None
        bs = self.blocks.block_size
        jobs = []
        for r, start, n in spans:
            r.kv_given.append((start, n))
            jobs.append((r.request_id, start, n, slots_for(self.blocks.block_table(r.request_id), bs, start, n)))

        def on_layer(layer: int) -> None:
            for rid, start, n, slots in jobs:
                sender.layer(rid, layer, start, n, layer_span(self.arena, layer, slots), self.layerwise)

        return on_layer

    def _send_kv(self, request: Request, out: RequestOutput) -> None:
        """The prompt is computed and its first token out: give the sender whatever it lacks (a
        prefix found in this worker's cache was never computed here), commit, and let go of the
        request. The transfer's outcome comes back later as an output of its own."""
        assert self.sender is not None
        rid, bs = request.request_id, self.blocks.block_size
        table = self.blocks.block_table(rid)
        covered = sorted(request.kv_given)
        gaps, pos = [], 0
        for start, n in covered:
            if start > pos:
                gaps.append((pos, start - pos))
            pos = max(pos, start + n)
        if pos < len(request.prompt_ids):
            gaps.append((pos, len(request.prompt_ids) - pos))
        for start, n in gaps:
            slots = slots_for(table, bs, start, n)
            for layer in range(self.arena.spec.num_layers):
                self.sender.layer(rid, layer, start, n, layer_span(self.arena, layer, slots), False)
        self.sender.commit(rid)
        # Its bytes are copied out: the blocks go back (cached here for the next prompt like it).
        self.scheduler.remove(rid)
        if self.sync is not None:
            self.sync.finished(request)  # here, that is: the decode node's ledger follows it from now on
        self._let_go(request)

    def _let_go(self, request: Request) -> None:
        """A request another worker continues: it ends here without a finish of its own."""
        request.status = Status.FINISHED
        self.requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)

    def _transfer_results(self) -> None:
        """Outputs for transfers that ended: where the decode worker finds the KV, or, every path
        having failed, that it must compute the prompt itself."""
        if self.sender is None:
            return
        for r in self.sender.results():
            to, num_tokens = self._sending.pop(r.request_id, (-1, 0))
            failed = not r.ok and r.error != "aborted"  # (an aborted one's request ended here already)
            h = Handoff(
                to,
                r.block_ids,
                num_computed=num_tokens,
                error=r.error,
                seconds=r.seconds,
                path=r.path,
                retries=r.retries,
                fallbacks=r.fallbacks,
                bytes=r.bytes,
                stream_seconds=r.stream_seconds,
                fallback=("recompute" if self.cfg.transfer.recompute else "error") if failed else "",
            )
            if failed and not self.cfg.transfer.recompute:
                why = f"KV transfer to worker {to} failed on every path ({r.error}); transfer.recompute is off"
                self._pending.append(RequestOutput(r.request_id, [], finish_reason="error", error=why, handoff=h))
            else:
                self._pending.append(RequestOutput(r.request_id, [], index=1, handoff=h))

    def _hand_off(self, request: Request, out: RequestOutput) -> None:
        """Give a prefilled request's KV to its decode worker: ownership changes in the ledger, no
        byte moves (blocks another request here shares are copied). If that cannot be done, this
        worker keeps decoding the request itself: slower for the others, lossless for the client."""
        to = request.decode_worker
        sync = self.sync
        if sync is None:
            out.handoff = Handoff(to, error="no ledger on this worker: KV cannot change owner", path="same_node")
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
            out.handoff = Handoff(to, error=why, path="same_node")
            return
        self.scheduler.detach(request)
        self._let_go(request)
        seconds = time.perf_counter() - t0
        out.handoff = Handoff(
            to, handed, sealed, request.num_computed, copied=copied, seconds=seconds, path="same_node"
        )

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
