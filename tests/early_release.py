"""Session-scoped engines that end after the last test of the run that uses them.

A session fixture lives until the whole run ends, so every engine the suite shares would stay
resident to the last test: on CI's 24 GiB machine the three shared SmolLM2 engines (~9 GB with
the server's) were still alive under the weight-update modules' own replicas, and the OOM killer
took an EngineCore (2026-11-29). The run's items are known once collected: each shared fixture
records the last item that needs it, and is released right after that item's teardown. A later
item that asked for it again (none does today) would get a fresh one from pytest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

LAST_USER_OF = pytest.StashKey[list[str]]()


class EarlyRelease:
    """Release callbacks by fixture name; each runs once (early, or at the fixture's own teardown)."""

    def __init__(self) -> None:
        self._releases: dict[str, Callable[[], None]] = {}

    def plan(self, items: list[pytest.Item], names: tuple[str, ...]) -> None:
        """Mark the last of ``items`` that uses each fixture in ``names``."""
        last: dict[str, pytest.Item] = {}
        for item in items:
            for name in names:
                if name in getattr(item, "fixturenames", ()):
                    last[name] = item
        for name, item in last.items():
            item.stash.setdefault(LAST_USER_OF, []).append(name)

    def register(self, name: str, release: Callable[[], None]) -> Callable[[], None]:
        """``release`` ends the fixture's engine; returns the once-only callable the fixture's
        teardown calls too."""
        done = False

        def once() -> None:
            nonlocal done
            if not done:
                done = True
                self._releases.pop(name, None)
                release()

        self._releases[name] = once
        return once

    def register_async(self, name: str, release: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``register`` for an engine on the session's event loop: released early, between tests (the
        loop is idle then), it runs to completion on that loop."""
        loop = asyncio.get_running_loop()
        done = False

        async def once_async() -> None:
            nonlocal done
            if not done:
                done = True
                self._releases.pop(name, None)
                await release()

        self._releases[name] = lambda: loop.run_until_complete(once_async())
        return once_async

    def after(self, item: pytest.Item) -> None:
        """After ``item``'s teardown: release what no later item uses."""
        for name in item.stash.get(LAST_USER_OF, []):
            release = self._releases.get(name)
            if release is not None:
                release()
