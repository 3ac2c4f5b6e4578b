"""``SlotTable`` at the edges vLLM's updates reach: moves and swaps with an empty side, a row
removed on its own, what ``admit`` is given, and the counts (the mutation run's selection for
``omni_engine/logits/slot_table.py`` with tests/test_logits_units.py; docs/mutation.md)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.sample.logits_processor.interface import MoveDirectionality

from omni_engine.logits import LiveRequest, SlotTable


def live(rid: str) -> LiveRequest:
    return LiveRequest(rid, None, None, [])


def held(table: SlotTable) -> dict[int, str]:
    return {row: r.request_id for row, r in table.items()}


def test_a_move_from_a_row_no_request_holds_frees_the_destination():
    released: list[str] = []
    table = SlotTable(release=lambda r: released.append(r.request_id))
    table.assign(1, live("b"))
    table.move(3, 1)  # row 3 held a request the processor declined
    assert held(table) == {} and released == ["b"]


def test_a_move_onto_a_held_row_releases_its_holder_and_moves_are_counted():
    released: list[str] = []
    table = SlotTable(release=lambda r: released.append(r.request_id))
    table.assign(0, live("a"))
    table.assign(1, live("b"))
    table.assign(2, live("c"))
    table.move(2, 1)
    table.move(1, 0)
    assert held(table) == {0: "c"} and released == ["b", "a"]
    assert table.stats.moved == 2


def test_a_swap_with_an_empty_row_moves_the_one_request():
    table = SlotTable()
    table.assign(0, live("a"))
    table.swap(0, 5)
    assert held(table) == {5: "a"}
    table.swap(2, 5)
    assert held(table) == {2: "a"}
    assert table.stats.swapped == 2


def test_a_row_removed_on_its_own_releases_its_request():
    released: list[str] = []
    table = SlotTable(release=lambda r: released.append(r.request_id))
    table.assign(0, live("a"))
    table.assign(1, live("b"))
    update = SimpleNamespace(removed=[1], added=[], moved=[])
    table.apply_batch_update(update, admit=lambda *args: None)
    assert held(table) == {0: "a"} and released == ["b"]


def test_admit_gets_the_row_params_prompt_and_output_of_an_added_request():
    seen = []
    params, prompt, output = object(), [1, 2], [3]

    def admit(row, p, prompt_ids, output_ids):
        seen.append((row, p, prompt_ids, output_ids))
        return live(f"r{row}")

    table = SlotTable()
    table.apply_batch_update(SimpleNamespace(removed=[], added=[(4, params, prompt, output)], moved=[]), admit)
    assert seen == [(4, params, prompt, output)]
    assert held(table) == {4: "r4"}


def test_clear_releases_every_request_held():
    released: list[str] = []
    table = SlotTable(release=lambda r: released.append(r.request_id))
    for row, rid in enumerate("abc"):
        table.assign(row, live(rid))
    table.clear()
    assert len(table) == 0 and sorted(released) == ["a", "b", "c"]
    assert table.stats.released == 3


def test_moves_and_swaps_from_a_batch_update_go_their_own_way():
    table = SlotTable()
    table.assign(0, live("a"))
    table.assign(1, live("b"))
    table.apply_batch_update(SimpleNamespace(removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]),
                             admit=lambda *args: None)
    assert held(table) == {0: "b", 1: "a"}
    table.apply_batch_update(SimpleNamespace(removed=[], added=[],
                                             moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]),
                             admit=lambda *args: None)
    assert held(table) == {0: "a"}
