"""Server-sent events: the encoding every streaming route writes (``text/event-stream``)."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"       # the last event of an OpenAI stream


def sse(obj) -> str:
    """One unnamed event carrying ``obj`` as JSON (an OpenAI stream chunk)."""
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def sse_event(name: str, data: dict) -> str:
    """One named event (Anthropic's: ``message_start``, ``content_block_delta``...)."""
    return f"event: {name}\n" + sse(data)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The response streaming ``events`` (text already encoded with ``sse`` / ``sse_event``)."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
