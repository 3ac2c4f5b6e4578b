"""A client process for ``tests/test_shm_hygiene.py``, to be killed.

Starts the tensor pipeline (``tests.helpers.tensor_pipeline_config``) with a
slow sink, sends one request and waits until it is in the sink, holding a
shared-memory slot of the source; then prints ``ready <json>`` (its pid, its
stages' pids, their segment prefixes and socket dirs) and waits for a signal.
SIGTERM/SIGINT shut the pipeline down and exit 0.

    python -m tests.shm_client_child     # from the repository root
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

NBYTES = 8 << 20


async def wait_in_sink(client, timeout: float = 60.0) -> None:
    """Poll until the request is in the sink and the source's slot is leased for it."""
    source, sink = (ctx.client for ctx in client.stage_contexts)
    async with asyncio.timeout(timeout):
        while not (sink.num_unfinished_requests() and (await source.call_utility_async("shm_stats"))["leased"]):
            await asyncio.sleep(0.05)


async def first_output(stream):
    return await stream.__anext__()


async def main() -> None:
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.entrypoints.signals import cancel_on_signals
    from tests.helpers import tensor_pipeline_config

    cancel_on_signals()
    async with await MultiStageEngineClient.from_config(tensor_pipeline_config()) as client:
        stream = client.generate({"nbytes": NBYTES, "sink_delay": 600}, None, "held")
        request = asyncio.create_task(first_output(stream))
        await wait_in_sink(client)
        stages = [replica for ctx in client.stage_contexts for replica in ctx.client.replicas]
        info = {"pid": os.getpid(), "stages": [s.process.pid for s in stages],
                "prefixes": [s.shm_prefix for s in stages], "runtime_dirs": [str(s.runtime_dir) for s in stages]}
        print("ready", json.dumps(info), flush=True)
        try:
            await asyncio.Event().wait()  # until a signal cancels us
        finally:
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
            await stream.aclose()


if __name__ == "__main__":
    import uvloop

    try:
        uvloop.run(main())
    except asyncio.CancelledError:
        sys.exit(0)  # a signal: the pipeline was shut down on the way out
