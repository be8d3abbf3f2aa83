"""The scheduler on tiny random models: concurrent requests are token-identical to the same requests run alone and
share passes; cancellation (queued, mid-prefill, mid-stream), timeouts, a full queue and a failing pass end only
the requests they concern and free their lanes; the context window ends a request with "length". Counts, never
timings."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from ssr import SSRConfig
from ssr.backends.transformers import TransformersBackend
from ssr.costs import CostTable
from ssr.engine import SSREngine
from ssr.errors import Cancelled, QueueFull, RequestTimeout
from tiny import TINY_FAMILY, VOCAB, tiny_model, tiny_tokenizer

BASE = dict(max_think_tokens=12, max_tokens=40, max_draft_tokens=24)
CONFIGS = [SSRConfig(enabled=False, **BASE), SSRConfig(draft_start=2, **BASE),
           SSRConfig(draft_start=1, draft_interval=3, max_drafts=2, **BASE)]


class HookedBackend(TransformersBackend):
    """The real tiny-model backend; ``hook(feeds)`` runs before each pass (to gate, cancel or fail one)."""

    hook = None
    new_lanes = 0  # requests that got a lane

    def new_lane(self, prefix=None, salt=None):
        self.new_lanes += 1
        return super().new_lane(prefix, salt)

    def step(self, feeds, want=None):
        if self.hook is not None:
            self.hook(feeds)
        return super().step(feeds, want)


def engine(**kwargs) -> SSREngine:
    tokenizer = tiny_tokenizer()
    backend = HookedBackend(tiny_model(0, scale=0.5), "tiny", {0}, 0)
    backend.tokenizer = tokenizer
    return SSREngine(backend, tokenizer, family=TINY_FAMILY, model_name="tiny", costs=CostTable.flat(), **kwargs)


def requests(n: int, seed: int = 0) -> list[tuple[list[int], SSRConfig]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, len(VOCAB)) for _ in range(rng.randrange(3, 30))], CONFIGS[i % len(CONFIGS)])
            for i in range(n)]


@pytest.fixture(scope="module")
def shared():
    return engine()


def alone(reqs) -> list[list[int]]:
    solo = engine()
    return [solo.generate(prompt, config=config).token_ids for prompt, config in reqs]


def settled(e: SSREngine) -> bool:
    """Nothing queued or running and no lane live but a parked one (the scheduler prunes right after the pass
    that ended the last request, so this is waited for)."""
    def idle():
        load = e.load_stats()
        return load["queued"] == 0 and load["running"] == 0 and e.backend.live_lanes <= 1
    try:
        _wait(idle, timeout=10)
    except AssertionError:
        raise AssertionError(f"not settled: {e.load_stats()}") from None
    return True


@pytest.mark.parametrize("n", [8, 32])
def test_threads_are_identical_to_alone_and_share_passes(shared, n):
    reqs = requests(n, seed=n)
    expected = alone(reqs)
    results: dict[int, object] = {}
    start = threading.Barrier(n)

    def worker(i):
        start.wait()
        results[i] = shared.generate(reqs[i][0], config=reqs[i][1])

    before = shared.scheduler.passes
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i].token_ids for i in range(n)] == expected
    passes = shared.scheduler.passes - before
    per_request = sum(r.stats["forward_passes"] for r in results.values())
    assert passes < per_request, (passes, per_request)  # requests rode in each other's passes
    assert all(r.stats["seconds"]["queue"] >= 0 for r in results.values())
    assert settled(shared)


@pytest.mark.parametrize("n", [8, 32])
def test_asyncio_requests_are_identical_to_alone(shared, n):
    reqs = requests(n, seed=100 + n)
    expected = alone(reqs)

    async def main():
        return await asyncio.gather(*(shared.agenerate(p, config=c) for p, c in reqs))

    assert [r.token_ids for r in asyncio.run(main())] == expected
    assert settled(shared)


def test_requests_sharing_a_system_prompt_prefill_it_once(shared):
    rng = random.Random(21)
    system = [rng.randrange(3, len(VOCAB)) for _ in range(60)]
    reqs = [(system + [rng.randrange(3, len(VOCAB)) for _ in range(5)], CONFIGS[i % 3]) for i in range(6)]
    expected = alone(reqs)
    results = [None] * len(reqs)
    first = shared.stream(*reqs[0][:1], config=reqs[0][1])
    next(first)  # the first request's lane holds the system prompt ...
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, shared.generate(reqs[i][0],
                                                                                          config=reqs[i][1])))
               for i in range(1, len(reqs))]
    for t in threads:
        t.start()
    results[0] = [ev.result for ev in first if ev.kind == "done"][0]
    for t in threads:
        t.join()
    assert [r.token_ids for r in results] == expected
    assert all(r.stats["reused_prompt_tokens"] >= 60 for r in results[1:])  # ... which the others fork


def test_two_sync_streams_interleave_in_one_thread(shared):
    """No lock is held across a caller's iteration: two streams advanced in turn by one thread both finish."""
    (p1, c1), (p2, c2) = requests(2, seed=7)
    a, b = shared.stream(p1, config=c1), shared.stream(p2, config=c2)
    done = {}
    while len(done) < 2:
        for name, stream in (("a", a), ("b", b)):
            if name not in done:
                event = next(stream)
                if event.kind == "done":
                    done[name] = event.result.token_ids
    assert [done["a"], done["b"]] == alone([(p1, c1), (p2, c2)])


def test_cancel_mid_stream_frees_lanes_and_others_stay_identical():
    e = engine()
    reqs = requests(4, seed=3)
    expected = alone(reqs)
    long_prompt, _ = reqs[0]
    stream = e.stream(long_prompt, config=SSRConfig(draft_start=1, max_think_tokens=200, max_tokens=300))
    next(stream)  # it is running, with a draft lane soon
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, e.generate(*reqs[i][:1],
                                                                                     config=reqs[i][1])))
               for i in range(1, 4)]
    for t in threads:
        t.start()
    stream.close()  # the caller stops reading: the request is cancelled at the next pass boundary
    for t in threads:
        t.join()
    assert [results[i].token_ids for i in range(1, 4)] == expected[1:]
    assert settled(e)


def test_cancel_while_queued_runs_no_prefill():
    e = engine(max_running=1)
    gate = threading.Event()
    e.backend.hook = lambda feeds: gate.wait()
    (p1, c1), (p2, c2) = requests(2, seed=5)
    first = threading.Thread(target=lambda: e.generate(p1, config=c1))
    first.start()
    _wait(lambda: e.load_stats()["running"] == 1)  # the first runs (held at its first pass) before the second queues
    cancel, errors = threading.Event(), []

    def queued():
        try:
            e.generate(p2, config=c2, _cancel=cancel)
        except Cancelled as exc:
            errors.append(exc)

    second = threading.Thread(target=queued)
    second.start()
    _wait(lambda: e.load_stats()["queued"] == 1)
    cancel.set()
    gate.set()
    first.join(), second.join()
    assert errors and "cancelled" in str(errors[0])
    assert e.backend.new_lanes == 1  # the cancelled request never got a lane: no prefill ran for it
    assert settled(e)


def test_cancel_mid_prefill_frees_lanes():
    """A long prompt prefills in chunks while another request decodes; cancelling it between chunks frees its
    lane and the other request's output is unchanged."""
    e = engine(prefill_chunk=4)
    (p1, c1), = requests(1, seed=9)
    expected = alone([(p1, c1)])[0]
    cancel, chunks = threading.Event(), []

    def hook(feeds):
        time.sleep(0.02)  # a slow model: the first request is still decoding when the long one arrives
        for lane, feed in feeds.items():
            if feed == [5] * 4:  # a chunk of the long prompt below
                chunks.append(lane)
                if len(chunks) == 2:
                    cancel.set()  # after its second chunk

    stream = e.stream(p1, config=c1)
    next(stream)
    e.backend.hook = hook
    errors = []

    def long_request():
        try:
            e.generate([5] * 60, config=SSRConfig(**BASE), _cancel=cancel)
        except Cancelled as exc:
            errors.append(exc)

    t = threading.Thread(target=long_request)
    t.start()
    tokens = [ev.result.token_ids for ev in stream if ev.kind == "done"][0]
    t.join()
    assert errors and len(chunks) >= 2 and tokens == expected
    assert settled(e)


def test_full_queue_and_timeouts_give_clear_errors():
    e = engine(max_queue=1, max_running=1)
    gate = threading.Event()
    e.backend.hook = lambda feeds: gate.wait()
    (p1, c1), (p2, c2), (p3, c3) = requests(3, seed=11)
    outcome = {}

    def run(name, prompt, config, **kw):
        try:
            outcome[name] = e.generate(prompt, config=config, **kw)
        except Exception as exc:  # noqa: BLE001
            outcome[name] = exc

    a = threading.Thread(target=run, args=("running", p1, c1), kwargs={"timeout": 0.2})
    a.start()
    _wait(lambda: e.load_stats()["running"] == 1)
    b = threading.Thread(target=run, args=("queued", p2, c2), kwargs={"timeout": 0.2})
    b.start()
    _wait(lambda: e.load_stats()["queued"] == 1)
    with pytest.raises(QueueFull, match="max_queue=1"):
        e.generate(p3, config=c3)
    threading.Timer(0.5, gate.set).start()
    a.join(), b.join()
    assert isinstance(outcome["running"], RequestTimeout) and "timed out" in str(outcome["running"])
    assert isinstance(outcome["queued"], RequestTimeout) and "queued" in str(outcome["queued"])
    assert settled(e)
    assert e.generate(p3, config=c3).token_ids == alone([(p3, c3)])[0]  # and it serves on


def test_a_failing_pass_fails_only_its_requests():
    """A pass that raises (here: the prefill pass of one request) fails that request with the error; the request
    decoding beside it finishes identical to alone, and the engine serves the next request."""
    e = engine()
    (p1, c1), (p2, c2) = requests(2, seed=13)
    expected = alone([(p1, c1), (p2, c2)])
    stream = e.stream(p1, config=c1)
    next(stream)
    # the failing request's lanes, known by its prompt when it opens them (a feed's tokens would not do: another
    # request's verify feed may hold the same tokens)
    failing: set[int] = set()
    open_lane = e.backend.new_lane

    def new_lane(prefix=None, salt=None):
        lane = open_lane(prefix, salt)
        if prefix == [7, 7, 7]:
            failing.add(lane)
        return lane

    def hook(feeds):
        if failing & set(feeds):
            raise RuntimeError("injected backend failure")

    e.backend.new_lane, e.backend.hook = new_lane, hook
    with pytest.raises(RuntimeError, match="injected"):
        e.generate([7, 7, 7], config=c2)
    failing.clear()  # its lanes are freed: their ids may serve the next request
    assert [ev.result.token_ids for ev in stream if ev.kind == "done"][0] == expected[0]
    assert e.generate(p2, config=c2).token_ids == expected[1]
    assert settled(e)


@pytest.mark.parametrize("config", [SSRConfig(enabled=False, max_think_tokens=40, max_tokens=200),
                                    SSRConfig(draft_start=1, max_think_tokens=40, max_tokens=200)])
def test_context_window_ends_the_request_with_length(shared, config):
    window = shared.context_window
    prompt = [random.Random(1).randrange(3, len(VOCAB)) for _ in range(window - 30)]
    result = shared.generate(prompt, config=config)
    assert result.prompt_tokens + len(result.token_ids) <= window
    assert result.finish_reason == "length" and "context window" in result.stats["finish_note"]
    plain = shared.generate(prompt, config=config.override(enabled=False))
    assert result.token_ids == plain.token_ids


def test_close_cancels_and_frees():
    e = engine()
    gate = threading.Event()
    e.backend.hook = lambda feeds: gate.wait()
    (p1, c1), = requests(1, seed=17)
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(_catch(lambda: e.generate(p1, config=c1))))
    t.start()
    _wait(lambda: e.load_stats()["running"] == 1)
    gate.set()
    with e:
        pass  # __exit__ closes it
    t.join()
    assert e.backend.live_lanes == 0
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(p1, config=c1)


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("condition not reached")


def test_work_run_on_the_engine_thread_shares_it_between_passes():
    """``run_on_engine_thread`` runs on the thread that steps every request (one OpenMP team: ssr.threads), between
    two passes: a request streaming meanwhile gives the tokens it gives alone; errors reach the caller; a closed
    engine refuses."""
    e = engine()
    stepped_on = set()
    e.backend.hook = lambda feeds: stepped_on.add(threading.current_thread())
    (p1, c1), = requests(1, seed=23)
    stream = e.stream(p1, config=c1)
    next(stream)  # the request is running
    passes = e.scheduler.passes
    ran_on = e.run_on_engine_thread(threading.current_thread)
    assert stepped_on == {ran_on} and ran_on is not threading.current_thread()
    tokens = next(ev.result.token_ids for ev in stream if ev.kind == "done")
    assert e.scheduler.passes > passes and tokens == alone([(p1, c1)])[0]
    with pytest.raises(ZeroDivisionError):
        e.run_on_engine_thread(lambda: 1 / 0)
    assert e.run_on_engine_thread(sum, [1, 2], start=3) == 6
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.run_on_engine_thread(int)
