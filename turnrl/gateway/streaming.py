"""Streamed calls: the reply's text goes to the client as the engine samples it, and what the client
was shown is what the session keeps.

``Gateway.answer`` hands a call's ``ReplyStream`` to the engine as its ``TOKEN_SINK``; the engines
that sample token by token (the embedded engine, vLLM's) push each token as it is sampled, others
give them all at the end. ``live_events`` turns the stream into the dialect's events (``Events``):
its opening once the call is planned, the content as it becomes certain, then the rest of the reply
(reasoning not yet shown, the content's remainder, tool calls, finish and usage) once it is done.

Content is shown only when no later token can take it back: a tail that may open a tag (an
unclosed ``<`` or ``[``, a partial end of turn, a partial UTF-8 character) waits, content that may be
a bare JSON or Python call (it starts with ``{`` or ``[``) waits, and once the parser sees a tool call
(or a malformed one) the rest waits for the end. The reasoning goes out whole with the first
content. If the final parse still disagrees with what was shown (a model that writes a lone
``</think>`` after its content), the message the session keeps, and the client's next call is
matched against, is the one the client was shown; ``turnrl_gateway_stream_diverged_total`` counts
it. The tokens recorded are the sampled ones either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from turnrl.gateway.call import ApiError, Begun, Completed, Events
from turnrl.support.errors import describe
from turnrl.tools.base import ParseResult


@dataclass
class Shown:
    """What the client of a streamed call has been sent of its reply."""

    reasoning: str | None = None  # None: not sent yet
    content: str = ""
    frozen: bool = False  # nothing more is sent before the end (a call began, or a parse disagreed)


class ReplyStream:
    """One streamed call's reply while it is sampled: the engine's tokens in (``push``, the call's
    ``TokenSink``), the content that is certain out (``take``)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.changed = asyncio.Event()  # tokens came since the last ``take``
        self.started = asyncio.Event()  # the call is planned and its generation starts
        self.shown = Shown()
        self.begun = Begun("", 0, 0)
        self._decode: Callable[[list[int]], str] = lambda ids: ""
        self._content: Callable[[str], str] = lambda text: text
        self._parse: Callable[[str], ParseResult] = lambda text: ParseResult()
        self._piecewise = False
        self._text, self._decoded = "", 0  # piecewise: the text of the first ``_decoded`` ids

    def begin(
        self,
        decode: Callable[[list[int]], str],
        piecewise: bool,
        content: Callable[[str], str],
        parse: Callable[[str], ParseResult],
        begun: Begun,
    ) -> None:
        """The call is planned: ``decode`` reads sampled ids as text (``piecewise``: a piece at a
        time, joined), ``content`` keeps what is certain of it, ``parse`` splits that."""
        self._decode, self._piecewise, self._content, self._parse = decode, piecewise, content, parse
        self.begun = begun
        self.started.set()

    def push(self, token_ids: Sequence[int]) -> None:
        """Tokens just sampled (the engine's ``TOKEN_SINK``)."""
        self.ids += token_ids
        self.changed.set()

    def take(self) -> tuple[str | None, str]:
        """What can be sent now: the reasoning (with the first content only), and new content."""
        self.changed.clear()
        shown = self.shown
        if shown.frozen or not self.ids:
            return None, ""
        parsed = self._parse(held_back(self._content(self._text_so_far())))
        if parsed.calls or parsed.errors or not parsed.content.startswith(shown.content):
            shown.frozen = True
            return None, ""
        if parsed.content[:1] in ("{", "[") or len(parsed.content) == len(shown.content):
            return None, ""  # a bare call may be coming, or nothing new
        reasoning = None
        if shown.reasoning is None:
            reasoning = shown.reasoning = parsed.reasoning.strip()
        delta, shown.content = parsed.content[len(shown.content) :], parsed.content
        return reasoning, delta

    def _text_so_far(self) -> str:
        """The text of the tokens so far (piecewise: each new piece decoded once; a piece that ends
        inside a character waits for the token that completes it)."""
        if not self._piecewise:
            return self._decode(self.ids)
        if self._decoded < len(self.ids):
            piece = self._decode(self.ids[self._decoded :])
            if not piece.endswith("\ufffd"):
                self._text, self._decoded = self._text + piece, len(self.ids)
        return self._text

    def settle(self, message: dict[str, Any]) -> tuple[str | None, str, bool]:
        """The end of the reply ``message``: the reasoning still to send (None: sent or none), the
        content still to send, and whether the message disagrees with what was shown; if it does,
        ``message`` becomes what the client was shown (the session matches the next call on it)."""
        shown = self.shown
        content, reasoning = message.get("content") or "", message.get("reasoning_content") or ""
        unsent = (reasoning or None) if shown.reasoning is None else None
        if content.startswith(shown.content) and shown.reasoning in (None, reasoning):
            return unsent, content[len(shown.content) :], False
        message["content"] = shown.content or None
        message.pop("reasoning_content", None)
        if shown.reasoning:
            message["reasoning_content"] = shown.reasoning
        return unsent, "", True


def held_back(text: str) -> str:
    """``text`` without a tail that a later token may change: a partial UTF-8 character, and an
    opening ``<`` or ``[`` not closed yet (a tag or a call may be starting there)."""
    text = text.rstrip("\ufffd")
    for opening, closing in (("<", ">"), ("[", "]")):
        cut = text.rfind(opening)
        if cut >= 0 and closing not in text[cut:]:
            text = text[:cut]
    return text


async def live_events(
    answer: asyncio.Future[Completed], live: ReplyStream, events: Events, counts: Counter[str]
) -> AsyncIterator[str]:
    """The events of a streamed call whose ``answer`` is under way and has started; ``counts``
    (the gateway's) counts an error after the start and a reply that disagreed with what was shown."""
    for event in events.opening(live.begun):
        yield event
    while not answer.done():
        changed: asyncio.Future[Any] = asyncio.ensure_future(live.changed.wait())
        try:
            await asyncio.wait([answer, changed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        reasoning, delta = live.take()
        if delta:
            for event in events.text(reasoning, delta):
                yield event
    try:
        done = answer.result()
    except Exception as exc:  # the engine failed (503), or a bug (500): said in the stream
        counts["errors"] += 1
        error = exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {describe(exc)}")
        for event in events.failed(error):
            yield event
        return
    reasoning, rest, disagreed = live.settle(done.reply.message)
    counts["stream_diverged"] += disagreed
    for event in events.closing(done, reasoning, rest):
        yield event


class LiveResponse(StreamingResponse):
    """A streamed call's response: its events as they come; a client that goes away before the
    end aborts the call (its generation is cancelled and its session stays as it was)."""

    def __init__(self, events: AsyncIterator[str], answer: asyncio.Future[Any]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        sending = asyncio.ensure_future(self.stream_response(send))
        try:
            await asyncio.wait({listening, sending}, return_when=asyncio.FIRST_COMPLETED)
            if sending.done() and not sending.cancelled():
                with contextlib.suppress(OSError):  # the client went away as the last event went out
                    sending.result()
        finally:
            listening.cancel()
            sending.cancel()
            self.answer.cancel()  # a no-op once it is done
            await asyncio.gather(listening, sending, self.answer, return_exceptions=True)
