"""How far a talker's requests may run ahead of their listeners while another request waits for its first audio.

A talker makes speech faster than it plays: once its thinker is done, a request's talker runs free
and is soon seconds ahead of its listener, and so is the code2wav work its frames bring. That work
is wasted on a listener that will not hear it for seconds, and on a machine without spare compute
(2 CPU cores: every request's talker and code2wav share them) it is taken from a request that
arrived meanwhile and whose listener hears nothing until its first frames are made. Measured on the
tiny Qwen3-Omni, 4 chats at once: first audio p95 2.3-3.7x a lone chat's p50 with 50 frames a chat,
2.06x with 8 (no one far ahead).

So, with a ``LeadLimit`` on the stage (``engine_args.lead_limit``), a request fed in parts
(``InputSession``) that leads its listener by more than ``lead_s`` seconds of speech waits before
its next chunk while another request of the stage has not made its first ``first_tokens`` tokens
(its first audio); it goes on as soon as that one has (or ends), or when its lead has shrunk to
``lead_s`` by the listener's clock. Chunks are at most ``chunk_tokens`` long, so a request that runs
free stops at a chunk's end to be held; vLLM keeps a waiting request's KV cache, so a held request
costs no compute and resumes exactly where it was (``input_session``). The listener's clock starts at
the request's first token (its first audio comes later), so the lead is never overstated.

Measured (tiny Qwen3-Omni, 2 cores, 4 chats at once, 50 frames each, 6-8 servers each way): with
``lead_s`` 0.5 the first audio p95 fell 9% (and its ratio to a lone chat's p50 from 2.58 to 2.38),
requests/s fell 12% (a held request leaves cores idle while a first audio's path waits on its hops);
``lead_s`` 1 or 2 moved nothing (few holds with answers this short), and 4-token chunks cost more than
they gave. A trade, so no shipped config sets it. On a GPU, where a decode step for one more request
is nearly free, holding gains nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec


class LeadLimitConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # tokens a second of speech takes (Qwen3-Omni's talker: 12.5 frames)
    tokens_per_second: Annotated[float, msgspec.Meta(gt=0)]
    lead_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    # the tokens a request's first audio needs (its first codec piece)
    first_tokens: Annotated[int, msgspec.Meta(ge=1)] = 4
    chunk_tokens: Annotated[int, msgspec.Meta(ge=1)] = 12


def lead_limit_of(stage_id: int, engine_args: dict[str, Any]) -> LeadLimit | None:
    """Pop ``lead_limit`` from an llm stage's ``engine_args`` (a mapping of ``LeadLimitConfig``'s fields)."""
    settings = engine_args.pop("lead_limit", None)
    if settings is None:
        return None
    try:
        return LeadLimit(msgspec.convert(settings, LeadLimitConfig))
    except msgspec.ValidationError as exc:
        raise ValueError(f"stage {stage_id}: engine_args.lead_limit: {exc}") from None


class LeadLimit:
    """The stage's requests fed in parts, and when each may take its next chunk."""

    def __init__(self, config: LeadLimitConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.sessions: set[Any] = set()  # InputSession (made, first_at, finish_reason)
        self.held = 0  # chunks that waited (a count for tests and metrics)
        self._changed = asyncio.Event()

    def opened(self, session: Any) -> None:
        self.sessions.add(session)

    def closed(self, session: Any) -> None:
        self.sessions.discard(session)
        self._notify()

    def observed(self, session: Any, before: int) -> None:
        """``session`` made tokens (it had ``before``): its clock starts at its first; reaching its
        first audio's tokens may let the others go."""
        if not before:
            session.first_at = self.clock()
        if before < self.config.first_tokens <= session.made or session.finish_reason is not None:
            self._notify()

    def chunk(self, session: Any, limit: int) -> int:
        """The tokens the session's next chunk may run to (its allowance ``limit``, at most a chunk)."""
        return min(limit, session.made + self.config.chunk_tokens)

    def wait_for(self, session: Any) -> float:
        """Seconds ``session`` must wait before its next chunk (0: none)."""
        if session.made < self.config.first_tokens or session.first_at is None:
            return 0.0
        if not any(self.starting(other) for other in self.sessions if other is not session):
            return 0.0
        lead = session.made / self.config.tokens_per_second - (self.clock() - session.first_at)
        return max(lead - self.config.lead_s, 0.0)

    def starting(self, session: Any) -> bool:
        """Still waiting for its first audio's tokens."""
        return session.finish_reason is None and session.made < self.config.first_tokens

    async def admit(self, session: Any) -> None:
        """Return once ``session`` may take its next chunk (woken when another's first audio is made
        or a request ends, else when its lead has shrunk to ``lead_s``; no polling)."""
        if (wait := self.wait_for(session)) <= 0:
            return
        self.held += 1
        while wait > 0 and session.finish_reason is None:
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)
            wait = self.wait_for(session)

    def _notify(self) -> None:
        # A fresh event per change: every waiter of the old one wakes, none misses a change.
        self._changed.set()
        self._changed = asyncio.Event()
