"""Every omni_engine module whose code runs for one chat request, in the client and in the stage.

    python scripts/request_path.py [PIPELINE_YAML]     (default: stage_configs/smollm2_text.yaml)

Starts the pipeline, sends a warm-up request, then traces one more (``sys.setprofile``
on every thread): in this process directly, in the stage process through a
``sitecustomize`` put on its ``PYTHONPATH`` that traces between two signals. Prints
the modules and how many Python calls each made. The README's "path of one request"
table is this list; ``tests/test_asyncllm_parity.py`` checks the client side of it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "/omni_engine/"

# Runs in the stage process (and harmlessly in this one): SIGUSR1 starts counting, SIGUSR2
# stops and writes the counts to $OMNI_TRACE_OUT.<pid>.
_SITECUSTOMIZE = '''
import collections, json, os, signal, sys, threading
if os.environ.get("OMNI_TRACE_OUT"):
    _on, _seen = [False], collections.Counter()
    def _prof(frame, event, arg):
        if _on[0] and event == "call" and "/omni_engine/" in frame.f_code.co_filename:
            _seen[frame.f_code.co_filename.rsplit("/omni_engine/", 1)[1]] += 1
    sys.setprofile(_prof); threading.setprofile(_prof)
    def _start(sig, frame): _on[0] = True
    def _stop(sig, frame):
        _on[0] = False
        with open(f"{os.environ['OMNI_TRACE_OUT']}.{os.getpid()}", "w") as fh:
            json.dump(_seen, fh)
    signal.signal(signal.SIGUSR1, _start); signal.signal(signal.SIGUSR2, _stop)
'''


def client_tracer(seen: collections.Counter) -> object:
    def prof(frame, event, arg):  # noqa: ANN001
        if event == "call" and PACKAGE in frame.f_code.co_filename:
            seen[frame.f_code.co_filename.rsplit(PACKAGE, 1)[1]] += 1
    return prof


async def trace(pipeline: str, out: Path) -> tuple[collections.Counter, collections.Counter]:
    from vllm import SamplingParams

    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

    client = await MultiStageEngineClient.from_config(pipeline, text_stage=True)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        prompt = {"type": "token", "prompt_token_ids": [1, 9690, 198, 2, 28, 29]}
        async for _ in client.generate(prompt, params, "warm-up"):
            pass
        pids = [r.pid for sid in client.stage_ids() for r in client.replica_status(sid) if r.pid]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        await asyncio.sleep(0.5)
        seen: collections.Counter = collections.Counter()
        sys.setprofile(client_tracer(seen))
        try:
            async for _ in client.generate(prompt, params, "traced"):
                pass
        finally:
            sys.setprofile(None)
        await asyncio.sleep(0.5)  # the stage's last sends
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        await asyncio.sleep(0.5)
        stage: collections.Counter = collections.Counter()
        for pid in pids:
            stage.update(json.loads(Path(f"{out}.{pid}").read_text()))
        return seen, stage
    finally:
        await client.shutdown_async()


def main() -> None:
    pipeline = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "stage_configs" / "smollm2_text.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        os.environ["OMNI_TRACE_OUT"] = str(Path(tmp, "trace"))
        client, stage = asyncio.run(trace(pipeline, Path(tmp, "trace")))
    for side, counts in (("client", client), ("stage", stage)):
        print(f"{side}:")
        for module, calls in sorted(counts.items()):
            print(f"  {calls:5d}  {module}")
    print(f"{len(set(client) | set(stage))} modules")


if __name__ == "__main__":
    main()
