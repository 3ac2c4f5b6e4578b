"""A program that starts a pipeline and ends it one way, for ``tests/test_client_lifecycle.py``.

    python -m tests.lifecycle_child MODE PIPELINE [--legacy]

PIPELINE: ``tensor`` (two generation stages, quick to start), ``text`` (SmolLM2 in vLLM) or
``speech-on-loop`` (the speech stage on the client's event loop: ``process: false, event_loop: client``).
MODE: how it ends --
  ``exit``          generate once, return from main without shutdown;
  ``on-loop``       shutdown() called synchronously inside the client's loop;
  ``from-thread``   shutdown() from another thread while the loop runs;
  ``after-stop``    shutdown() after the client's loop stopped (not closed);
  ``after-close``   shutdown() after the client's loop was closed;
  ``from-signal``   shutdown() from a SIGUSR1 handler while the loop runs.
Prints one JSON line first: the stage pids, socket dirs and shared-memory prefixes to check;
then, for the shutdown modes, one with the seconds shutdown() took; last, the threads still
running besides the main one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

from vllm import SamplingParams

from omni_engine.config import parse_pipeline_config
from tests.helpers import TTS_FACTORY, tensor_pipeline_config
from tests.stress.pipeline import REPO, speech_config, start_pipeline


async def start(pipeline: str, legacy: bool):
    if pipeline == "tensor":
        client = await start_pipeline(tensor_pipeline_config(use_shm=not legacy), legacy=legacy)
        prompt, params = {"nbytes": 1 << 20}, None
    elif pipeline == "speech-on-loop":
        client = await start_pipeline(parse_pipeline_config({"stage_args": [{
            "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
            "runtime": {"process": False, "event_loop": "client"}, "final_output": True,
            "final_output_type": "audio"}]}, "<speech on the client's loop>"))
        prompt, params = "Hello there.", None
    else:
        from omni_engine.models.prepare import prepare_model

        config = speech_config(REPO / "stage_configs" / "smollm2_text.yaml", model=prepare_model("smollm2"))
        client = await start_pipeline(config, legacy=legacy)
        prompt, params = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", SamplingParams(max_tokens=8)
    outputs = [o async for o in client.generate(prompt, params, "once")]
    assert outputs and outputs[-1].finished
    stages = [replica for ctx in client.stage_contexts for replica in ctx.client.replicas]
    print(json.dumps({
        "pids": [s.process.pid for s in stages if s.process is not None],
        "runtime_dirs": [str(s.runtime_dir) for s in stages if getattr(s, "runtime_dir", None)],
        "shm_prefixes": [s.shm_prefix for s in stages if getattr(s, "shm_prefix", None)],
    }), flush=True)
    return client


KEEP: list = []


def timed_shutdown(client) -> None:
    t0 = time.monotonic()
    client.shutdown()
    print(json.dumps({"shutdown_s": time.monotonic() - t0}), flush=True)


def main() -> None:
    mode, pipeline = sys.argv[1], sys.argv[2]
    legacy = "--legacy" in sys.argv
    if mode == "exit":
        # Kept referenced to the end, as a module global would be: only the exit can clean up.
        KEEP.append(asyncio.run(start(pipeline, legacy)))
        print(json.dumps({"returned_at": time.time()}), flush=True)
        return
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(start(pipeline, legacy))
    if mode == "on-loop":
        async def inside() -> None:
            timed_shutdown(client)
            await asyncio.sleep(0.2)  # the loop runs on: the cancelled tasks finish here
        loop.run_until_complete(inside())
    elif mode == "from-thread":
        done = asyncio.Event()
        thread = threading.Thread(target=lambda: (timed_shutdown(client), loop.call_soon_threadsafe(done.set)))

        async def from_thread() -> None:
            thread.start()  # (once the loop runs: started before, the thread may find it not running yet)
            await done.wait()
        loop.run_until_complete(from_thread())
        thread.join()
    elif mode == "after-stop":
        timed_shutdown(client)
    elif mode == "after-close":
        loop.close()
        timed_shutdown(client)
    elif mode == "from-signal":
        signal.signal(signal.SIGUSR1, lambda *_: timed_shutdown(client))

        async def wait_for_signal() -> None:
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.5)
        loop.run_until_complete(wait_for_signal())
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    client.shutdown()  # idempotent: a second call returns at once
    if not loop.is_closed():
        loop.close()
    print(json.dumps({"threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()]}),
          flush=True)


if __name__ == "__main__":
    main()
