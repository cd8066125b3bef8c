"""Admission through the degradation ladder (control/ladder/degrade.py) on a registry of workers with injected
status reports and requests in flight: bounded per-priority queues, refusals by predicted TTFT (low
first, high never), L4's caps, L5's breaker with the high-priority reserve, the orders workers get;
and the TTFT prediction and context truncation it relies on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from steadfast.config import DegradationConfig, SchedulerConfig, SloConfig
from steadfast.config.base import ConfigError
from steadfast.control.fleet.delivery import Flight, Watermark
from steadfast.control.fleet.signals import (
    TTFT_LEARN_FROM_S,
    Calibration,
    Queued,
    Running,
    Window,
    WorkerLoad,
    predict_ttft,
)
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.control.http.errors import APIError, refusal_error
from steadfast.control.http.openai_models import CompletionRequest
from steadfast.control.http.serving import ServingContext, admit
from steadfast.control.http.truncate import cut_chat, cut_prompt
from steadfast.control.ladder.degrade import Degradation, Sources
from steadfast.control.ladder.ladder import Level
from steadfast.control.ladder.plan import Plan, Refusal
from steadfast.control.ladder.view import ladder_view
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.wire.worker import AddRequest, Degrade, Priority, SamplingParams, WorkerRole, WorkerState, WorkerStatus

pytestmark = pytest.mark.unit

SCHED = SchedulerConfig(max_num_batched_tokens=512, prefill_floor_tokens=64, decode_step_target_ms=250)


def flight(rid: str, priority: Priority, prompt: int, owner: int, delivered: int = 0, max_tokens: int = 64) -> Flight:
    add = AddRequest(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), int(priority))
    return Flight(add, asyncio.Queue(), Watermark(owner, delivered=[5] * delivered))


class Service:
    """One mixed worker (id 0) whose step costs 10 ms + 1 ms per token, with requests placed on it."""

    def __init__(self, cached: int = 0, **cfg: object) -> None:
        """`cached`: tokens of every prompt the worker holds cached (its cache events)."""
        self.registry = WorkerRegistry()
        self.registry.add(0, "ipc://w0", WorkerRole.MIXED)
        self.report(used=0)
        self.flights: list[Flight] = []
        self.sent: list[Degrade] = []
        self.d = Degradation(
            DegradationConfig(**cfg),  # type: ignore[arg-type]
            SloConfig(),
            SCHED,
            16,
            Sources(self.registry, lambda: self.flights, self._send, lambda worker, ids: min(cached, len(ids) - 1)),
        )
        # Predictions trusted from the first request (a server trusts them once 8 were checked).
        self.d.ttft_model = Calibration(min_samples=0)
        self.d.tpot_model = Calibration(min_samples=0)

    async def _send(self, orders: Degrade) -> None:
        self.sent.append(orders)

    def report(self, used: int, total: int = 1000) -> None:
        cost = {"step_base_ms": 10.0, "step_decode_ms": 1.0, "step_prefill_ms": 1.0}
        self.registry.observe(WorkerStatus(0, 1, WorkerRole.MIXED, WorkerState.READY, total, used, **cost))

    def admit(self, priority: Priority, prompt: int = 64, output: int = 64) -> Plan:
        """The plan of an admitted request; a refusal raised as the HTTP layer turns it into an error."""
        plan = self.d.plan(f"r{len(self.flights)}-{priority}", priority, [1] * prompt, output)
        if isinstance(plan, Refusal):
            raise refusal_error(plan)
        return plan


def test_predicted_ttft_counts_the_queue_ahead_at_or_above_the_priority_and_waits_for_kv():
    w = WorkerLoad(0, 0.010, 0.002, 0.001, kv_total=1000, kv_used=0)
    alone = predict_ttft(w, 100, Priority.NORMAL, SCHED, 16)
    assert alone == pytest.approx(0.010 + 0.100)  # one step of 100 prompt tokens
    w.queued = [Queued(Priority.LOW, 400, 0, 0.0)] * 4 + [Queued(Priority.HIGH, 300, 0, 0.0)]
    assert predict_ttft(w, 100, Priority.NORMAL, SCHED, 16) < predict_ttft(w, 100, Priority.LOW, SCHED, 16)
    assert predict_ttft(w, 100, Priority.HIGH, SCHED, 16) == predict_ttft(w, 100, Priority.NORMAL, SCHED, 16)
    w.queued = []
    w.running = [Running(remaining_tokens=50, blocks=10)] * 100
    paced = predict_ttft(w, 100, Priority.NORMAL, SCHED, 16)
    assert paced > alone  # decodes share each step, prefill is paced beside them
    w.kv_used = 995  # no room for 7 blocks: it waits for the first request to finish
    assert predict_ttft(w, 100, Priority.NORMAL, SCHED, 16) >= paced + 50 * w.decode_step_s()
    assert predict_ttft(WorkerLoad(0, 0.0, 0.0, 0.0, 10, 0), 100, Priority.NORMAL, SCHED, 16) == 0.0  # not measured


def test_prompts_ahead_decode_beside_the_later_ones_and_a_cached_prefix_is_not_computed():
    w = WorkerLoad(0, 0.010, 0.002, 0.001, kv_total=1000, kv_used=0)
    w.running = [Running(remaining_tokens=50, blocks=10)] * 40
    w.queued = [Queued(Priority.NORMAL, 100, 0, 0.0)] * 20
    predicted = predict_ttft(w, 100, Priority.NORMAL, SCHED, 16)
    # 2100 tokens, 140 a step (what 250 ms leave beside decoding the 40 running and half the 20 ahead:
    # 110 ms): 15 steps, after half the step in progress (45 ms).
    assert predicted == pytest.approx(15 * (0.010 + 50 * 0.002 + 140 * 0.001) + 0.045)
    # The ladder predicts a prompt's TTFT from what its worker does not hold cached, and counts a
    # request placed there by what it did not.
    plain, cached = Service(), Service(cached=480)
    for s in (plain, cached):
        s.flights = [flight(f"r{i}", Priority.NORMAL, 10, 0, delivered=2) for i in range(8)]
        s.flights += [flight("queued", Priority.NORMAL, 500, 0)]
        s.flights[-1].cached = 480
    whole, rest = (s.d.plan("new", Priority.NORMAL, [1] * 600, 64).predicted_ttft_ms for s in (plain, cached))
    assert rest < whole
    assert cached.d.loads()[0].queued[0].prompt_tokens == 20


def test_window_percentiles_forget_old_values():
    w = Window(10.0)
    for i in range(100):
        w.add(float(i), now=0.0)
    assert w.percentile(0.99, now=1.0) == 98.0 and w.percentile(0.5, now=1.0) == 49.0
    w.add(1000.0, now=20.0)
    assert w.percentile(0.5, now=20.0) == 1000.0 and w.count(20.0) == 1


def test_each_priority_has_a_bounded_queue():
    s = Service(max_queued_low=3, enabled=False)
    for i in range(3):
        s.flights.append(flight(f"low{i}", Priority.LOW, 64, 0))
    with pytest.raises(APIError) as refused:
        s.admit(Priority.LOW)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"]
    s.admit(Priority.NORMAL)  # other priorities' queues are their own


def test_predicted_ttft_refuses_low_first_then_normal_and_never_high():
    s = Service()
    # 400 prompt tokens queued ahead (two requests: more than the one worker serves at once, a crowd): a
    # new 64-token request is predicted at one step of 10 ms + 464 x 1 ms: L1 (over 0.8 x 500 ms), within
    # normal's 500 ms target, over 2 x low's 200 ms.
    s.flights += [flight("n0", Priority.NORMAL, 200, 0), flight("n1", Priority.NORMAL, 200, 0)]
    with pytest.raises(APIError) as low:
        s.admit(Priority.LOW)
    assert low.value.status == 429
    assert "wait about" in low.value.message and int(low.value.headers["Retry-After"]) >= 1
    assert s.d.ladder.level >= Level.L1
    s.admit(Priority.NORMAL)
    # 440 tokens queued: normal's ~514 ms is over its target; as a burst (within ttft_refuse x it), it waits.
    lenient = Service()
    lenient.flights = [flight("n0", Priority.NORMAL, 220, 0), flight("n1", Priority.NORMAL, 220, 0)]
    assert 500 < lenient.admit(Priority.NORMAL).predicted_ttft_ms < 1000
    with pytest.raises(ConfigError):
        DegradationConfig(ttft_refuse=0.5)  # would refuse requests predicted within their target
    strict = Service(ttft_refuse=1.0)  # refused at the target itself
    strict.flights = [flight("n0", Priority.NORMAL, 220, 0), flight("n1", Priority.NORMAL, 220, 0)]
    with pytest.raises(APIError) as normal:
        strict.admit(Priority.NORMAL)
    assert "over its 500 ms target" in normal.value.message
    # 4 x 500 tokens queued: normal is refused too; high never (only high requests are ahead of it).
    s.flights = [flight(f"n{i}", Priority.NORMAL, 500, 0) for i in range(4)]
    with pytest.raises(APIError):
        s.admit(Priority.NORMAL)
    s.admit(Priority.HIGH)
    # A shorter queue (~424 ms): normal's bar passes, low's (2 x its p50 200 ms) does not.
    s = Service()
    s.d.set_level(Level.L4)
    s.flights = [flight("n", Priority.NORMAL, 175, 0), flight("m", Priority.NORMAL, 175, 0)]
    s.admit(Priority.NORMAL)
    with pytest.raises(APIError):
        s.admit(Priority.LOW)


def test_past_its_ttft_target_a_request_waits_while_there_is_capacity_and_is_refused_in_overload():
    """Predicted past its TTFT target but within ttft_refuse (2) x it: admitted while the observed TPOT
    p99 keeps its target (the queue will drain), refused once it does not (no capacity to spare)."""
    s = Service()
    s.flights = [flight(f"n{i}", Priority.NORMAL, 220, 0) for i in range(2)]  # a new normal one: ~514 ms
    s.admit(Priority.NORMAL)
    s.d.ended(f"r1-{Priority.NORMAL}")
    for i in range(5):  # streams finishing at 90 ms a token, over the 80 ms TPOT p99 target
        s.d.finished(f"done{i}", Priority.NORMAL, 0.090, 64)
    asyncio.run(s.d.tick())
    with pytest.raises(APIError, match="over its 500 ms target"):
        s.admit(Priority.NORMAL)


def test_short_requests_slow_beside_a_burst_of_prefills_do_not_count_as_overload():
    """Requests of a few tokens, each slow because it decoded beside its burst's prefills, say nothing
    of decode capacity: a request predicted past its TTFT target (within 2x) is still admitted."""
    s = Service()
    s.flights = [flight("n0", Priority.NORMAL, 440, 0)]
    for i in range(32):  # a burst of 16-token requests at 120 ms a token (15 decoded after the first)
        s.d.finished(f"short{i}", Priority.NORMAL, 0.120, 15)
    asyncio.run(s.d.tick())
    assert ladder_view(s.d)["capacity_tpot_p99_ms"] == 0.0
    s.admit(Priority.NORMAL)


def test_l4_shortens_normal_and_low_and_leaves_high_alone():
    s = Service(max_tokens_cap=32, max_context_tokens=100)
    s.d.set_level(Level.L4)
    normal = s.admit(Priority.NORMAL)
    assert normal.max_tokens_cap == 32 and normal.context_cap == 100
    high = s.admit(Priority.HIGH)
    assert not high.shortened and high.level == Level.L4


def test_l5_refuses_normal_and_low_and_admits_high_within_its_reserve():
    s = Service(high_reserve=2)
    s.d.set_level(Level.L5)
    for p in (Priority.LOW, Priority.NORMAL):
        with pytest.raises(APIError) as refused:
            s.admit(p)
        assert refused.value.status == 503 and refused.value.code == "circuit_open"
    s.flights.append(flight("h0", Priority.HIGH, 64, 0, delivered=3))
    s.admit(Priority.HIGH)  # 1 in flight, 1 admitted now: the reserve of 2 is used up
    with pytest.raises(APIError) as high:
        s.admit(Priority.HIGH)
    assert high.value.status == 503


def test_orders_follow_the_level_and_the_seed_rules_for_speculation():
    s = Service()
    assert s.d.orders(s.d.snapshot()) == Degrade()
    s.d.set_level(Level.L2)
    assert s.d.orders(s.d.snapshot()).speculate_below == 1  # high keeps speculating under load alone
    s.report(used=900)  # KV over 85 %: nobody speculates
    assert s.d.orders(s.d.snapshot()).speculate_below == 0
    s.d.set_level(Level.L3)
    orders = s.d.orders(s.d.snapshot())
    assert orders.offload_from == Priority.LOW and orders.kv_target == 0.8
    asyncio.run(s.d.tick())
    assert s.sent[-1] == orders


def test_truncation_keeps_the_system_prompt_and_latest_turns():
    def encode(messages: list[dict[str, str]]) -> list[int]:
        return [1] * sum(10 + len(m["content"]) for m in messages)

    chat = [{"role": "system", "content": "s" * 20}]
    for i in range(10):
        chat.append({"role": "user", "content": f"question {i}" + "q" * 30})
        chat.append({"role": "assistant", "content": f"answer {i}" + "a" * 30})
    chat.append({"role": "user", "content": "last"})
    ids, dropped = cut_chat(chat, 200, encode)
    assert len(ids) <= 200 and dropped > 0
    assert len(ids) == len(encode([chat[0], *chat[1 + dropped :]]))
    assert chat[1 + dropped]["role"] == "user"  # the kept turns start with the user
    ids, dropped = cut_chat(chat, 10, encode)  # not even system + last fit: those two are kept
    assert dropped == len(chat) - 2
    assert cut_prompt([7, *range(100)], 10, bos=7) == [7, *range(91, 100)]
    assert cut_prompt(list(range(5)), 10, bos=7) == list(range(5))


def test_what_would_slow_every_stream_past_its_tpot_target_is_refused_low_from_l1_normal_from_l4():
    s = Service()
    s.d.set_level(Level.L1)
    # 50 streams decoding: with one more (8 prompt tokens, 64 out) each token is expected to take
    # 10 + 51 x 1 + 8 / 64 = 61 ms, under normal's 80 ms target; a low one behind it 62.25 ms, over low's
    # share of it (60 ms).
    s.flights = [flight(f"run{i}", Priority.NORMAL, 10, 0, delivered=2) for i in range(50)]
    s.admit(Priority.NORMAL, prompt=8)
    with pytest.raises(APIError) as low:
        s.admit(Priority.LOW, prompt=8)
    assert low.value.status == 429 and "each token would take about" in low.value.message
    s.flights += [flight(f"more{i}", Priority.NORMAL, 10, 0, delivered=2) for i in range(20)]
    s.admit(Priority.NORMAL, prompt=8)  # 82 ms, but normal is held to its TPOT only once the SLO stays broken
    s.d.set_level(Level.L4)
    with pytest.raises(APIError):
        s.admit(Priority.NORMAL, prompt=8)
    s.admit(Priority.HIGH)
    assert s.d.orders(s.d.snapshot()).step_target_ms == 80.0  # L1+: steps kept within the TPOT target


def test_predictions_learn_from_what_requests_measured():
    s = Service()
    assert s.d.ttft_model.factor == 1.0 and s.d.tpot_model.factor == 1.0
    for i in range(200):  # every request's TTFT is twice, its TPOT half what the model says
        rid = f"x{i}"
        own_tpot = s.d.loads()[0].tpot_s(100, 64)
        plan = s.d.plan(rid, Priority.NORMAL, [1] * 100, 64)
        own_ttft = plan.predicted_ttft_ms / 1000 / s.d.ttft_model.factor
        s.d.first_token(rid, Priority.NORMAL, 2 * own_ttft)
        s.d.finished(rid, Priority.NORMAL, 0.5 * own_tpot, 64)
        s.d.ended(rid)
    assert s.d.ttft_model.factor == pytest.approx(2.0, rel=0.05)
    assert s.d.tpot_model.factor == pytest.approx(0.5, rel=0.05)
    assert ladder_view(s.d)["calibration"] == {
        "ttft": pytest.approx(2.0, rel=0.05),
        "tpot": pytest.approx(0.5, rel=0.05),
    }


def test_an_idle_service_shows_no_load_whatever_the_calibration_learnt():
    s = Service()
    s.d.tpot_model.learn(0.001, 1.0)  # a burst on a starved machine taught it tokens take far longer
    s.d.tpot_model.learn(0.001, 1.0)
    assert s.d.tpot_model.factor > 1
    assert s.d.snapshot().load == 0.0  # nothing runs: nothing to slow down, the level can fall
    s.flights = [flight("r", Priority.NORMAL, 10, 0, delivered=2)]
    assert s.d.snapshot().load > 0
    (row,) = ladder_view(s.d)["workers"]
    assert row["worker"] == 0 and row["running"] == 1 and row["predicted_tpot_ms"] > 0


def test_before_predictions_were_checked_only_a_far_miss_is_refused():
    """A fresh server's line may be off by the calibration's whole range: until 8 predictions were checked
    a request is refused only when even the most favourable correction (x 0.5) misses. Two normal prompts
    of 300 tokens ahead: 800 ms predicted for a low one (bar 2 x 200 ms); of 500: 1280 ms."""
    s = Service()
    s.d.ttft_model = Calibration()  # a fresh server's: nothing measured yet
    s.flights = [flight(f"n{i}", Priority.NORMAL, 300, 0) for i in range(2)]
    s.admit(Priority.LOW)  # over its target, within what an unchecked line may be off by
    s.flights = [flight(f"n{i}", Priority.NORMAL, 500, 0) for i in range(2)]
    with pytest.raises(APIError):
        s.admit(Priority.LOW)  # a miss even at half the prediction
    s.flights = [flight(f"n{i}", Priority.NORMAL, 300, 0) for i in range(2)]
    for _ in range(8):
        s.d.ttft_model.learn(1.0, 1.0)
    with pytest.raises(APIError):
        s.admit(Priority.LOW)  # checked now: the moderate miss is refused too


def test_short_ttft_predictions_do_not_move_the_calibration():
    """At c = 32 a 50 ms prediction measures 150 ms (the step it lands in, the router's own latency) while
    a 700 ms one measures ~700: learnt from the short ones, the factor would inflate the long ones that
    admission refuses on."""
    c = Calibration(floor=TTFT_LEARN_FROM_S)
    for _ in range(50):
        c.learn(0.05, 0.15)
    assert c.factor == 1.0 and not c.trusted
    for _ in range(50):
        c.learn(0.05, 0.15)
        c.learn(0.7, 0.7)
    assert c.factor == pytest.approx(1.0) and c.trusted


@pytest.mark.parametrize(("n", "best_of", "runs"), [(1, None, 1), (3, None, 3), (1, 4, 4), (2, 5, 5)])
def test_the_ladder_plans_every_run_a_request_decodes(model_path, n, best_of, runs):
    """`best_of` above `n` decodes best_of sequences of which n are kept: the ladder weighs all of them."""
    planned: list[int] = []

    def plan(rid: str, priority: Priority, prompt: list[int], tokens: int) -> Plan:
        planned.append(tokens)
        return Plan(Level.L0)

    tok = GGUFTokenizer.from_gguf(model_path)
    client = SimpleNamespace(workers=[SimpleNamespace(ready=True, status=None)], pending=0)
    ctx = ServingContext(client, tok, "m", 2048, 16, None)  # type: ignore[arg-type]
    ctx.degradation = SimpleNamespace(plan=plan, ended=lambda rid: None)  # type: ignore[assignment]
    body = CompletionRequest(model="m", prompt="Hi", max_tokens=10, n=n, best_of=best_of)
    asyncio.run(admit(ctx, body, tok.encode("Hi"), 10, "cmpl", None))  # type: ignore[arg-type]
    assert planned == [10 * runs]
