"""``OmniHTTPWeightSyncClient``: vLLM's ``HTTPVLLMWeightSyncClient`` with an API key and the fence.

vLLM's client posts to its RL routes without credentials; ``omni-engine serve``
guards every route with ``--api-key``. This one sends the key, and adds the
routes a fenced update uses around the four of vLLM's protocol.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient


class OmniHTTPWeightSyncClient(HTTPVLLMWeightSyncClient):
    """The weight-sync routes of an ``omni-engine serve`` (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300) -> None:
        super().__init__(base_url, timeout)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        response = requests.request(method, f"{self.base_url}/{path}", headers=self.headers, timeout=self.timeout,
                                    **kwargs)
        if response.status_code >= 400:
            # The server's message says what was wrong; raise_for_status alone would drop it.
            raise RuntimeError(f"{method} /{path}: HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        self._request("POST", path, json=json)

    def pause(self, mode: str = "wait") -> None:
        self._request("POST", "pause", params={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "resume")

    def reset_prefix_cache(self) -> None:
        self._request("POST", "reset_prefix_cache")

    def weight_version(self) -> str:
        return self._request("GET", "weight_info")["weight_version"]
