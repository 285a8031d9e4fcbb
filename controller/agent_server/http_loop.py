"""One asyncio event loop on its own thread, for the controller's HTTP work.

The controller is threads (controller.py says why); HTTP with hundreds of concurrent
long-polls is what asyncio is for. So both meet here: the policy endpoint's server and
every client session run on this one loop, on the thread `rolloutdb-http`, and the
pumps reach it through `submit` (a coroutine in, a `concurrent.futures.Future` out, the
same shape as the engine's `submit`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class HttpLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rolloutdb-http", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop; its result or exception arrives through the future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for it (never from the loop's own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("HttpLoop.call from the loop's own thread would deadlock; await the coroutine")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what still runs, stop the loop and join its thread."""
        if self.loop.is_closed():
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_cancel_rest()).result(10)
        except Exception:  # noqa: BLE001 - closing: best effort
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
