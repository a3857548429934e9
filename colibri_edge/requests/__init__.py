"""Requests: the request scheduler (scheduler: one thread packs each step from a queue), sampling, the
Engine that user code holds, its asyncio front end (aio) and text in and out (textio)."""
