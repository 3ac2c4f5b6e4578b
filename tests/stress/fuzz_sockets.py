"""Long fuzz of both stage sockets: ``python tests/stress/fuzz_sockets.py --seconds 600``.

The CI version (``tests/test_fuzz_sockets.py``) sends ~150 hostile messages
per socket; this one keeps going in rounds until the time is up, against one
real stage process behind a raw harness (every answer checked) and one real
``StageEngineCoreClient`` (its PULL socket flooded by a stranger), and checks
after every round that both still serve a valid request and leak nothing.
A failing example is printed by Hypothesis, shrunk, with the seed to replay it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

from omni_engine.connectors.shm import ShmPool, list_segments, stage_prefix  # noqa: E402
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient  # noqa: E402
from tests.helpers import RawFrameClient
from tests.wire_fuzz import OutputInjector, RawStage, fuzz_stage_spec, stage_barrage  # noqa: E402


def _check_stage(stage: RawStage, segments: list[str]) -> None:
    assert stage.process.is_alive(), stage.process.describe_exit()
    assert stage.settle() == [], "stage sent something after settling"
    assert list_segments(stage.shm_prefix) == segments, "stage made or lost shared-memory segments"


async def _check_client(client: StageEngineCoreClient) -> None:
    assert not client.is_dead, client.dead_error
    await client.submit_request("probe", {"nbytes": 2 << 20})
    async with asyncio.timeout(30):
        output = await client.get_output_async()
    assert output.request_id == "probe" and bool((output.multimodal_output["tensor"] == (2 << 20) % 251).all())
    del output
    assert client.num_unfinished_requests() == 0


async def main(seconds: float, examples: int) -> None:
    foreign = ShmPool(stage_prefix(f"omni_1_{os.urandom(4).hex()}", 0), max_bytes=1 << 20, min_slot=4096)
    extra = (foreign.lease(4096, "theirs").name,)
    stage = RawStage(9, fuzz_stage_spec())
    client = RawFrameClient(8, process=fuzz_stage_spec())
    await client.start()
    injector = OutputInjector(client)
    verdicts: Counter = Counter()
    rounds, deadline = 0, time.monotonic() + seconds
    try:
        segments = list_segments(stage.shm_prefix)
        while time.monotonic() < deadline:
            rounds += 1
            verdicts += stage_barrage(stage, examples, extra)
            _check_stage(stage, segments)
            await asyncio.to_thread(injector.barrage, examples, extra)
            await _check_client(client)
            left = max(0.0, deadline - time.monotonic())
            print(f"round {rounds}: {rounds * examples} messages per socket, {left:.0f} s left; "
                  f"stage had to answer {dict(verdicts)}", flush=True)
    finally:
        injector.close()
        await client.shutdown()
        stage.close()
        foreign.close()
    print(f"ok: {rounds} rounds, {rounds * examples} hostile messages per socket, nothing crashed or leaked")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to keep fuzzing")
    parser.add_argument("--examples", type=int, default=1000, help="hostile messages per socket per round")
    parser.add_argument("--verbose", action="store_true", help="show the client's warning for every dropped message")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR)
    asyncio.run(main(args.seconds, args.examples))
