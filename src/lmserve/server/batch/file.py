"""`lmserve run-batch`: one input file into one results file, on an engine started in this process.

The lines run through the same ServerState and route handling as `serve` (no HTTP, no event loop of
uvicorn's): the engine thread batches them continuously while this loop writes each result as it lands.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from lmserve.config import EngineConfig
from lmserve.server.batch.lines import Line, LineResult, ResultsFile, run_lines
from lmserve.server.key_file import ANONYMOUS
from lmserve.server.media import MediaPolicy
from lmserve.server.metrics import ServerMetrics
from lmserve.server.state import ServerConfig, ServerState, launch_engine


@dataclass
class Summary:
    """What a run did, for the closing line and --summary."""

    requests: int  # lines run this time
    skipped: int  # lines whose results were already in the output (a resumed run)
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    images: int = 0  # images in the lines answered (200): an alt-text job's rate is images/s
    seconds: float = 0.0  # from the first line submitted to the last result written (model load excluded)

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def images_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "output_tok_s": self.output_tok_s, "images_s": self.images_s}


def offline_state(config: EngineConfig, served_model_name: str, window: int, strict_fields: bool = False,
                  media: MediaPolicy = MediaPolicy()) -> ServerState:
    """A ServerState with the engine loaded, warmed up and its thread started (the queue limit above `window`;
    `strict_fields`: a line's unknown body field is a 400, as `serve --strict-fields` answers it; `media`: where a
    line's image parts may come from, as `serve --allowed-media-domains` says)."""
    state = ServerState(ServerConfig(served_model_name, max_queued_requests=window, engine_step_timeout=None,
                                     strict_fields=strict_fields, media=media),
                        ServerMetrics(served_model_name))
    launch_engine(state, config)
    return state


def run_file(state: ServerState, lines: list[Line], results: ResultsFile, window: int,
             on_result: Callable[[LineResult], None]) -> Summary:
    """Run `lines` (those not done yet) into `results`; each result is flushed before the next is awaited."""
    summary = Summary(requests=len(lines), skipped=0)
    start = time.perf_counter()

    async def go() -> None:
        async for r in run_lines(state, lines, ANONYMOUS, window):
            results.append(r.result)
            summary.prompt_tokens += r.prompt_tokens
            summary.completion_tokens += r.completion_tokens
            summary.images += r.images
            on_result(r)

    try:
        asyncio.run(go())
    finally:
        summary.seconds = time.perf_counter() - start
        results.close()
        state.async_engine.shutdown()
    return summary


def count_outcomes(summary: Summary, before: dict[str, int], results: ResultsFile) -> None:
    """completed/failed of this run: the results file's counts less what it held before."""
    summary.completed = results.counts["completed"] - before["completed"]
    summary.failed = results.counts["failed"] - before["failed"]
