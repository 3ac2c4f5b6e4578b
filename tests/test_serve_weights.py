"""Weight updates through ``omni-engine serve``'s RL routes (``VLLM_SERVER_DEV_MODE=1``), driven by a
trainer process: vLLM's own ``HTTPVLLMWeightSyncClient`` with our ``shm`` backend (a trainer written
for vLLM, unchanged), and served completions that say which version made them.

The oracle is the row swap of test_weight_update: SmolLM2 ties its embeddings, so the checkpoint
with two token rows swapped answers the original answer with those ids exchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import auth_headers

pytestmark = pytest.mark.llm

REPO = Path(__file__).resolve().parents[1]
PUSH = REPO / "examples" / "rl" / "push_weights.py"
QUESTION = [{"role": "user", "content": "Tell me a short story about a cat."}]


def chat(server: dict, *, stream: bool = False, max_tokens: int = 24) -> httpx.Response:
    body = {"model": server["model"], "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "stream": stream}
    return httpx.post(f"{server['url']}/v1/chat/completions", json=body, headers=auth_headers(server), timeout=120)


def answer_ids(server: dict) -> tuple[list[int], str, httpx.Response]:
    response = chat(server)
    assert response.status_code == 200, response.text[:500]
    data = response.json()
    return data["choices"][0]["token_ids"], data.get("weight_version"), response


def swapped_checkpoint(smollm2_path: Path, ids: list[int], prompt_ids: set[int], out: Path) -> tuple[int, int]:
    """The checkpoint with two rows of the embeddings swapped (ids the answer uses, the prompt not)."""
    from safetensors.torch import load_file, save_file

    i, j = [t for t in dict.fromkeys(ids) if t not in prompt_ids][:2]
    state = load_file(next(smollm2_path.glob("*.safetensors")))
    embed = state["model.embed_tokens.weight"].clone()
    embed[[i, j]] = embed[[j, i]]
    state["model.embed_tokens.weight"] = embed
    save_file(state, out)
    return i, j


def push(server: dict, weights: Path, version: str, *extra: str) -> dict:
    args = [sys.executable, str(PUSH), "--url", server["url"], "--weights", str(weights), "--version", version, *extra]
    if server.get("api_key") and "--vllm-client" not in extra:
        args += ["--api-key", server["api_key"]]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt_token_ids(smollm2_path: Path) -> set[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return set(tokenizer(rendered)["input_ids"])


def check_row_swap_push(server: dict, smollm2_path: Path, tmp_path: Path, *extra: str) -> None:
    """Push B (rows swapped) then A again through the routes; answers and versions follow."""
    ids_a, version_a, _ = answer_ids(server)
    i, j = swapped_checkpoint(smollm2_path, ids_a, prompt_token_ids(smollm2_path), tmp_path / "b.safetensors")
    base = int(version_a) if version_a and version_a.isdigit() else 0
    try:
        push(server, tmp_path / "b.safetensors", str(base + 1), *extra)
        info = httpx.get(f"{server['url']}/weight_info", headers=auth_headers(server), timeout=30).json()
        assert info == {"weight_version": str(base + 1)}
        ids_b, version_b, response = answer_ids(server)
        assert ids_b == [j if t == i else i if t == j else t for t in ids_a]
        assert version_b == str(base + 1) and response.headers["x-weight-version"] == str(base + 1)
        assert response.json()["weight_versions"] == {"0": [str(base + 1)]}
    finally:
        # Back to the original weights for the other tests of this server.
        push(server, next(smollm2_path.glob("*.safetensors")), str(base + 2), *extra)
    ids_again, version_again, _ = answer_ids(server)
    assert ids_again == ids_a and version_again == str(base + 2)


def test_vllms_own_weight_sync_client_drives_a_full_update(text_server, smollm2_path, tmp_path):
    server = {**text_server, "model": "smollm2-test"}
    check_row_swap_push(server, smollm2_path, tmp_path, "--vllm-client")


def test_streamed_completions_carry_the_weight_version(text_server):
    server = {**text_server, "model": "smollm2-test"}
    version = httpx.get(f"{server['url']}/weight_info", timeout=30).json()["weight_version"]
    response = chat(server, stream=True, max_tokens=8)
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert events and all(event["weight_version"] == version for event in events[1:]), events[:3]
