"""A minimal Server-Sent Events parser (https://html.spec.whatwg.org/#event-stream-interpretation)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass


@dataclass
class SseEvent:
    """One dispatched event: its type (``message`` when unnamed), data and id."""

    event: str
    data: str
    id: str | None = None


class SseDecoder:
    """Feed lines (without their terminators); get events when a blank line dispatches them."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self._has_data = False

    def feed(self, line: str) -> SseEvent | None:
        line = line.rstrip("\r\n")
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "id":
            if "\0" not in value:
                self._id = value
        # "retry" and unknown fields are ignored
        return None

    def flush(self) -> SseEvent | None:
        """Dispatch a final event the stream did not terminate with a blank line."""
        return self._dispatch()

    def _dispatch(self) -> SseEvent | None:
        if not self._has_data and not self._event:
            return None
        ev = SseEvent(self._event or "message", "\n".join(self._data), self._id)
        self._event = ""
        self._data = []
        self._has_data = False
        return ev


def _some(ev: SseEvent | None) -> list[SseEvent]:
    return [] if ev is None else [ev]


def iter_sse(lines: Iterable[str]) -> Iterator[SseEvent]:
    """Parse an iterable of lines into events."""
    dec = SseDecoder()
    for line in lines:
        yield from _some(dec.feed(line))
    yield from _some(dec.flush())


async def aiter_sse(lines: AsyncIterable[str]) -> AsyncIterator[SseEvent]:
    """Parse an async iterable of lines into events."""
    dec = SseDecoder()
    async for line in lines:
        for ev in _some(dec.feed(line)):
            yield ev
    for ev in _some(dec.flush()):
        yield ev
