"""A rollout generator that feeds a transfer queue the way slime's ``base_generator.py`` does.

    python -m omni_engine.transfer_queue.example_generator --buffer-url http://127.0.0.1:8889 \\
        [--openai-url http://127.0.0.1:8000/v1 --model smollm2] [--instances 8] [--samples 16]

Each worker thread takes a prompt, samples an answer (from an OpenAI-compatible endpoint such as
``omni-engine serve`` when one is given, else a made-up one), scores it against the expected
answer, and posts ``{uid, instance_id, messages, reward, extra_info}`` to ``/buffer/write`` with
``requests.post(json=...)``-style HTTP and the same retry (a repeated post is harmless: the queue
drops a uid it has).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

# The queue's key, as the server reads it (omni_engine.transfer_queue.security.API_KEY_ENV;
# not imported, so that this script runs with the standard library alone).
API_KEY_ENV = "OMNI_ENGINE_TRANSFER_QUEUE_API_KEY"
PROBLEMS = [(f"What is {a} + {b}? Answer with the number only.", str(a + b))
            for a, b in [(2, 3), (7, 5), (12, 30), (9, 9), (41, 1), (100, 23), (6, 7), (15, 15)]]


def send_data_to_buffer(buffer_url: str, data: dict, attempts: int = 2, api_key: str | None = None) -> bool:
    """slime's ``send_data_to_buffer``: POST the trajectory, retry on failure. ``api_key``
    (default ``$OMNI_ENGINE_TRANSFER_QUEUE_API_KEY``) goes as a bearer token; a refused
    key is not retried."""
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json"}
    if api_key := api_key or os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {api_key}"
    for _ in range(attempts):
        req = urllib.request.Request(buffer_url.rstrip("/") + "/buffer/write", body, headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return True
        except urllib.error.HTTPError as exc:
            print(f"send data to buffer failed, error: {exc}")
            if exc.code == 401:
                return False
        except (urllib.error.URLError, OSError) as exc:
            print(f"send data to buffer failed, error: {exc}")
    return False


def sample(prompt: str, answer: str, openai_url: str | None, model: str | None) -> tuple[str, str]:
    """(response text, finish reason)."""
    if openai_url is None:
        return (answer if random.random() < 0.5 else str(int(answer) + 1)), "stop"
    from openai import OpenAI

    client = OpenAI(base_url=openai_url, api_key="EMPTY")
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=32, temperature=1.0)
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def reward(response: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+", response)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def run(buffer_url: str, instances: int, samples: int, workers: int = 8, openai_url: str | None = None,
        model: str | None = None) -> int:
    """Generate ``samples`` trajectories for each of ``instances`` prompts; returns how many were posted."""
    jobs = [(f"math_{i}", *PROBLEMS[i % len(PROBLEMS)]) for i in range(instances) for _ in range(samples)]
    random.shuffle(jobs)  # asynchronous, out of order, as real rollouts finish
    posted = 0
    lock = threading.Lock()

    def one(job: tuple[str, str, str]) -> None:
        nonlocal posted
        instance_id, prompt, answer = job
        text, finish = sample(prompt, answer, openai_url, model)
        data = {"uid": str(uuid.uuid4()), "instance_id": instance_id,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}],
                "reward": reward(text, answer),
                "extra_info": {"timestamp": str(time.time()), "finish_reason": finish, "label": answer}}
        if send_data_to_buffer(buffer_url, data):
            with lock:
                posted += 1

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, jobs))
    return posted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buffer-url", default="http://127.0.0.1:8889")
    ap.add_argument("--openai-url", default=None, help="an OpenAI-compatible /v1 endpoint (default: made-up answers)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--samples", type=int, default=16, help="samples per prompt (the queue's group_size)")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    n = run(args.buffer_url, args.instances, args.samples, args.workers, args.openai_url, args.model)
    print(f"posted {n} trajectories")


if __name__ == "__main__":
    main()
