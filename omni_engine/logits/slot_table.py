"""Which request holds which row of the logits: vLLM's batch updates applied by request.

A logits processor sees rows, and vLLM recycles them: a finished request's row is
given to the next one (sometimes reported only in ``added``), ``condense()`` moves the
last rows down into holes (``UNIDIRECTIONAL``), and attention backends swap rows
(``SWAP``). State kept by row index therefore drifts to the wrong request. A
``SlotTable`` applies each ``BatchUpdate`` in vLLM's order (removed, added, moved) to a
map of row -> :class:`LiveRequest`, so a processor keys its state by request and asks
the table for the current row of each one.

Pure Python (no vLLM import): the stage's request tagging uses it too.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# The key in each request's ``SamplingParams.extra_args`` under which a stage puts the
# request's pipeline id: vLLM hands processors the params, never a request id.
REQUEST_ID_KEY = "omni_request_id"

_unkeyed = itertools.count()


def tag_request(params: Any, request_id: str) -> Any:
    """``params`` with the request's id in its ``extra_args`` (a shallow copy: a caller's
    params object may be shared by many requests, as the seed's prompt list was)."""
    tagged = copy.copy(params)
    tagged.extra_args = {**(params.extra_args or {}), REQUEST_ID_KEY: request_id}
    return tagged


def request_id_of(params: Any) -> str:
    """The pipeline's id of the request these params belong to (tagged by the stage), or
    a fresh id when the params were not tagged (plain vLLM): then each admission is its
    own request."""
    extra = getattr(params, "extra_args", None) or {}
    rid = extra.get(REQUEST_ID_KEY)
    return rid if isinstance(rid, str) else f"unkeyed-{next(_unkeyed)}"


@dataclass(eq=False)
class LiveRequest:
    """A request in the batch, as a processor sees it.

    ``output_token_ids`` grows as the request decodes (on the V1 runner it is vLLM's own
    list; on Model Runner V2 a view of the runner's token buffer). ``state`` is what the
    processor's ``new_state`` returned for it.
    """

    request_id: str
    params: Any
    prompt_token_ids: Sequence[int] | None
    output_token_ids: Sequence[int]
    state: Any = None


@dataclass
class SlotStats:
    """What the batch did, counted: evidence that reuse and moves really happened."""

    admitted: int = 0
    released: int = 0
    reused: int = 0  # a request given a row an earlier request held
    moved: int = 0  # one-way moves (condense)
    swapped: int = 0  # two-way swaps

    def as_dict(self) -> dict[str, int]:
        return dict(admitted=self.admitted, released=self.released, reused=self.reused,
                    moved=self.moved, swapped=self.swapped)


@dataclass
class SlotTable:
    """Row -> request for the requests a processor acts on, kept right under vLLM's updates.

    ``release`` is called once for each request that leaves the table (its row removed
    or taken by another request); requests the processor declined (``admit`` returned
    None) are not held, but their rows still count for reuse.
    """

    release: Callable[[LiveRequest], None] = lambda request: None
    stats: SlotStats = field(default_factory=SlotStats)
    _rows: dict[int, LiveRequest] = field(default_factory=dict)
    _ever_used: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self._rows)

    def items(self) -> Iterator[tuple[int, LiveRequest]]:
        return iter(sorted(self._rows.items()))

    def get(self, row: int) -> LiveRequest | None:
        return self._rows.get(row)

    # ------------------------------------------------------------ operations
    def remove(self, row: int) -> None:
        if (request := self._rows.pop(row, None)) is not None:
            self._release(request)

    def assign(self, row: int, request: LiveRequest | None) -> None:
        """``request`` now holds ``row`` (None: a request the processor does not act on);
        whatever held it before has left (a reused row may be reported only as added)."""
        self.remove(row)
        if row in self._ever_used:
            self.stats.reused += 1
        self._ever_used.add(row)
        if request is not None:
            self.stats.admitted += 1
            self._rows[row] = request

    def move(self, src: int, dst: int) -> None:
        """One-way: the request at ``src`` now holds ``dst``; ``dst``'s holder has left."""
        self.stats.moved += 1
        request = self._rows.pop(src, None)
        self.remove(dst)
        if request is not None:
            self._rows[dst] = request

    def swap(self, a: int, b: int) -> None:
        self.stats.swapped += 1
        ra, rb = self._rows.pop(a, None), self._rows.pop(b, None)
        if ra is not None:
            self._rows[b] = ra
        if rb is not None:
            self._rows[a] = rb

    def apply_batch_update(self, update: Any, admit: Callable[[int, Any, Any, Any], LiveRequest | None]) -> None:
        """Apply a V1 ``BatchUpdate`` in vLLM's order: removed, then added, then moved.

        ``admit(row, params, prompt_token_ids, output_token_ids)`` makes the
        :class:`LiveRequest` of an added request, or None to leave it alone.
        """
        from vllm.v1.sample.logits_processor.interface import MoveDirectionality

        for row in update.removed:
            self.remove(row)
        for row, params, prompt, output in update.added:
            self.assign(row, admit(row, params, prompt, output))
        for src, dst, direction in update.moved:
            if direction == MoveDirectionality.SWAP:
                self.swap(src, dst)
            else:
                self.move(src, dst)

    def clear(self) -> None:
        for row in list(self._rows):
            self.remove(row)

    def _release(self, request: LiveRequest) -> None:
        self.stats.released += 1
        self.release(request)
