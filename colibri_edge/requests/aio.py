"""AsyncEngine: the request core for asyncio programs (`await generate()`, `async for` over stream()).

The core thread puts each event in the request's queue and wakes the awaiting task through
loop.call_soon_threadsafe; nothing blocks the event loop. A task cancelled while streaming (or an
`async for` left early) cancels its request, whose blocks return to the pool within one step.

Closing: `async with AsyncEngine.open(...) as ae:` (or `await ae.aclose()`) in a coroutine; `with
AsyncEngine.open(...) as ae:` (or `ae.close()`) around asyncio.run(...) in plain code. Either closes
the Engine (once: closing again does nothing); a request still running then ends with an error."""
from __future__ import annotations

import asyncio
import queue

from .scheduler import DONE, ERROR, TOKEN, text_piece
from .engine import Engine, Generation
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def open(cls, path, backend=None, **kw) -> "AsyncEngine":
        return cls(Engine.open(path, backend=backend, **kw))

    @property
    def closed(self) -> bool:
        return self.engine.closed

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def aclose(self):
        """Close the engine from a coroutine (the core thread is joined in a worker thread: the event
        loop never blocks)."""
        await asyncio.to_thread(self.engine.close)

    def close(self):
        """Close the engine from plain code (outside a running event loop, e.g. after asyncio.run;
        in a coroutine, await aclose() instead: this one blocks until the core thread has stopped)."""
        self.engine.close()

    def submit(self, prompt, priority=0, index=0, **gen):
        """-> (the Request, an async iterator of its Events); leaving the iterator early cancels it.
        Call from a coroutine (it binds the running loop)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake():
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:            # the loop has closed: nobody is waiting any more
                pass
        req = self.engine.submit(prompt, priority=priority, index=index, notify=wake, **gen)
        return req, self._drain(req, ready)

    def submit_n(self, prompt, n, priority=0, **gen):
        """n samples of one prompt sharing its prefill (Engine.submit_n): [(request, events)] * n."""
        loop = asyncio.get_running_loop()
        readies = [asyncio.Event() for _ in range(n)]

        def waker():
            def wake():
                try:
                    loop.call_soon_threadsafe(lambda: [r.set() for r in readies])
                except RuntimeError:
                    pass
            return wake
        reqs = self.engine.submit_n(prompt, n, priority=priority, notify=waker(), **gen)
        return [(r, self._drain(r, ev)) for r, ev in zip(reqs, readies)]

    @staticmethod
    async def _drain(req, ready):
        try:
            while True:
                ready.clear()
                while True:
                    try:
                        ev = req.events.get_nowait()
                    except queue.Empty:
                        break
                    yield ev
                    if ev.kind in (DONE, ERROR):
                        return
                await ready.wait()
        finally:
            req.cancel()

    async def events(self, prompt, priority=0, **gen):
        """Yields the request's core Events (TOKEN ..., then DONE or ERROR)."""
        _, it = self.submit(prompt, priority, **gen)
        try:
            async for ev in it:
                yield ev
        finally:
            await it.aclose()

    async def generate(self, prompt, **gen) -> Generation:
        """Engine.generate's result (the generated token ids and their finish_reason) and arguments."""
        out = Generation()
        async for ev in self.events(prompt, **gen):
            if ev.kind == ERROR:
                raise ev.error
            if ev.kind == TOKEN:
                out.append(ev.token)
            elif ev.kind == DONE:
                out.finish_reason = ev.reason
        return out

    async def stream(self, prompt, **gen):
        """Text pieces as they are generated (never splitting a UTF-8 character), ending before the
        first stop string (Engine.stream)."""
        from .textio import StopCutter, StreamDecoder
        dec = StreamDecoder(self.engine.codec)
        cutter = StopCutter(gen.get("stop"))
        async for ev in self.events(prompt, **gen):
            piece = cutter.push(text_piece(dec, ev))
            if piece:
                yield piece
        tail = cutter.push(dec.flush()) + cutter.finish()
        if tail:
            yield tail

    async def chat(self, messages, **gen) -> str:
        """Engine.chat: the reply's text (a harmony reply's final message), before the first stop string."""
        from .textio import cut_at_stop
        if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"messages={messages!r:.80}: expected a list of "
                               "{'role': str, 'content': str} (use generate() for a plain prompt)")
        ids = await self.generate(list(messages), **gen)
        return cut_at_stop(self.engine.codec.reply(ids)[0], gen.get("stop"))
