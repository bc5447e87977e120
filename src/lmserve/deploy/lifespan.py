"""The ASGI lifespan protocol, driven by hand: an app served without uvicorn still starts and stops its
background work (lmserve's batch-job runner) the way uvicorn would start it."""

from __future__ import annotations

import asyncio


class Lifespan:
    """A running app's lifespan task; `stop()` sends the shutdown and waits for it."""

    def __init__(self, task: asyncio.Task, shutdown: asyncio.Event, done: asyncio.Future) -> None:
        self._task, self._shutdown, self._done = task, shutdown, done

    @classmethod
    async def start(cls, app) -> "Lifespan":
        """Send lifespan.startup and wait until the app has started (an app that fails it raises here)."""
        loop = asyncio.get_running_loop()
        started, done, shutdown = loop.create_future(), loop.create_future(), asyncio.Event()
        sent_startup = False

        async def receive() -> dict:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await shutdown.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict) -> None:
            kind = message["type"]
            target = started if kind.startswith("lifespan.startup") else done
            if not target.done():
                target.set_result(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        task = asyncio.ensure_future(app(scope, receive, send))
        message = await started
        if message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app failed to start: {message.get('message', '')}")
        return cls(task, shutdown, done)

    async def stop(self, timeout: float = 30.0) -> None:
        """Send lifespan.shutdown and wait (bounded) for the app to finish it."""
        self._shutdown.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
