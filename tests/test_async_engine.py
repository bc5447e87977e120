"""AsyncEngine's inbox: typed messages from the asyncio side to the engine thread, on a fake engine (no model)."""

from __future__ import annotations

import asyncio
import types

import pytest

from lmserve.engine.async_engine import AbortRequest, AsyncEngine, Wake
from lmserve.request import CompletionDelta, EngineRequest
from lmserve.sampling_params import SamplingParams


class FakeEngine:
    """Just enough of LLMEngine: a request finishes in the step after it is added, echoing its prompt."""

    def __init__(self) -> None:
        self.added: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.queued: list[EngineRequest] = []
        self.last_step = None
        self.executor = types.SimpleNamespace(on_fatal=None)  # AsyncEngine hooks a rank death here

    def close(self) -> None:
        """Nothing to stop (AsyncEngine.shutdown calls it)."""

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        raise AssertionError("AsyncEngine leaves checking to its caller or to add")

    def add(self, request: EngineRequest) -> None:
        if request.request_id == "bad":
            raise ValueError("refused on the engine thread")
        self.added.append(request)
        self.queued.append(request)

    def abort(self, request_id: str) -> list[CompletionDelta]:
        self.aborted.append(request_id)
        return []

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def step(self) -> list[CompletionDelta]:
        done, self.queued = self.queued, []
        return [CompletionDelta(m.request_id, 0, m.prompt, "x", None, finished=True) for m in done]


def inbox(engine: AsyncEngine) -> list:
    items = []
    while not engine._inbox.empty():
        items.append(engine._inbox.get_nowait())
    return items


def test_abort_and_shutdown_send_typed_messages():
    engine = AsyncEngine(FakeEngine())  # not started: the messages stay in the inbox
    engine.abort("r1")
    engine.shutdown()
    assert inbox(engine) == [AbortRequest("r1"), Wake()]


def test_a_bare_tuple_is_not_a_message():
    with pytest.raises(KeyError):
        AsyncEngine(FakeEngine())._handle(("abort", "r1"))


async def _collect(engine: AsyncEngine, request_id: str, ids: list[int],
                   max_tokens: int | None = None) -> list[CompletionDelta]:
    return [d async for d in engine.generate(EngineRequest(request_id, ids, SamplingParams(max_tokens=1),
                                                                          max_tokens))]


def test_add_reaches_the_engine_thread_and_its_deltas_come_back():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()
    try:
        deltas = asyncio.run(_collect(engine, "r1", [5, 6]))
    finally:
        engine.shutdown()
    assert [(d.request_id, d.token_ids, d.finished) for d in deltas] == [("r1", [5, 6], True)]
    assert [m.request_id for m in fake.added] == ["r1"] and not engine._thread.is_alive()


def test_an_add_the_engine_refuses_fails_only_its_own_stream():
    engine = AsyncEngine(FakeEngine())
    engine.start()
    try:
        with pytest.raises(ValueError, match="refused on the engine thread"):
            asyncio.run(_collect(engine, "bad", [1]))
        assert len(asyncio.run(_collect(engine, "good", [1]))) == 1
    finally:
        engine.shutdown()


def test_the_checked_max_tokens_travels_with_the_add():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()
    try:
        asyncio.run(_collect(engine, "checked", [1], max_tokens=7))
        asyncio.run(_collect(engine, "unchecked", [1]))
    finally:
        engine.shutdown()
    assert [(m.request_id, m.max_tokens) for m in fake.added] == [("checked", 7), ("unchecked", None)]


class ThreeStepEngine(FakeEngine):
    """Every queued request gets one delta a step (its prompt ids one by one) and finishes on its third."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = {}

    def step(self) -> list[CompletionDelta]:
        deltas = []
        for m in self.queued:
            k = self.sent[m.request_id] = self.sent.get(m.request_id, 0) + 1
            deltas.append(CompletionDelta(m.request_id, 0, [m.prompt[k - 1]], str(k), None, finished=k == 3))
        self.queued = [m for m in self.queued if self.sent[m.request_id] < 3]
        return deltas


def test_a_steps_deltas_for_many_streams_arrive_whole_and_in_order():
    # a step hands all its deltas to the event loop in one callback: every stream still gets each of its own, in order
    engine = AsyncEngine(ThreeStepEngine())
    engine.start()

    async def many() -> list[list[CompletionDelta]]:
        return await asyncio.gather(*(_collect(engine, f"r{i}", [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(16)))

    try:
        streams = asyncio.run(many())
    finally:
        engine.shutdown()
    for i, deltas in enumerate(streams):
        assert [(d.request_id, d.token_ids, d.text, d.finished) for d in deltas] == [
            (f"r{i}", [10 * i + k], str(k + 1), k == 2) for k in range(3)]
