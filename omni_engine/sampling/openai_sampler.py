"""``OpenAISampler``: any OpenAI-compatible endpoint through the official ``openai`` client.

``omni-engine serve``, plain vLLM, or a hosted API. ``n`` answers are one
chat completion (``n=``); rate limits (429), 5xx, connection errors and
timeouts are retried by the client with exponential backoff (honouring
``Retry-After``), ``max_retries`` times; an item that still fails is recorded
with its error. ``extra_params`` go into the request body as they are.

Token counts: the prompt's from ``usage``; each answer's from the ``token_ids``
vLLM returns when asked (``return_token_ids``; probed at ``initialize``), else
from ``usage`` when there is one answer, else unknown (None).
"""

from __future__ import annotations

import os
from typing import Any

from omni_engine.sampling.base import BaseSampler, SamplerInitError
from omni_engine.sampling.config import SamplerConfig
from omni_engine.sampling.items import Response, SampleTask

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_RETRIES = 5
PROBE_TIMEOUT_S = 30.0


class OpenAISampler(BaseSampler):
    kind = "openai"

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self.client: Any = None
        self._token_ids = False

    def _api_key(self) -> str:
        if self.config.api_key is not None:
            return self.config.api_key
        env = self.config.api_key_env or "OPENAI_API_KEY"
        key = os.environ.get(env)
        if key is None and self.config.api_key_env is not None:
            raise SamplerInitError(f"sampler.api_key_env: environment variable {env} is not set")
        return key or "EMPTY"  # local servers without --api-key take any key

    async def initialize(self) -> None:
        import openai

        await super().initialize()

        self.client = openai.AsyncOpenAI(
            base_url=self.config.base_url, api_key=self._api_key(),
            timeout=self.config.timeout or DEFAULT_TIMEOUT_S,
            max_retries=self.config.max_retries if self.config.max_retries is not None else DEFAULT_MAX_RETRIES)
        probe = self.client.with_options(timeout=PROBE_TIMEOUT_S, max_retries=1)
        where = f"sampler.base_url {self.config.base_url}"
        try:
            served = [m.id async for m in probe.models.list()]
        except openai.AuthenticationError as exc:
            raise SamplerInitError(f"{where}: the API key was refused ({exc.status_code}); set sampler.api_key "
                                   "or sampler.api_key_env") from None
        except openai.APIError as exc:
            raise SamplerInitError(f"{where}: not reachable as an OpenAI API ({type(exc).__name__}: {exc})") from None
        if served and self.config.model not in served:
            raise SamplerInitError(f"sampler.model: {self.config.model!r} is not served at {self.config.base_url} "
                                   f"(it serves: {', '.join(served)})")
        # One tiny request with every parameter: a bad extra_params fails here, not per item.
        try:
            reply = await probe.chat.completions.create(**self._request([{"role": "user", "content": "hi"}], 1, None,
                                                                        max_tokens=1, token_ids=True))
            self._token_ids = getattr(reply.choices[0], "token_ids", None) is not None
        except openai.BadRequestError:
            try:  # an endpoint that refuses return_token_ids (not vLLM): without it
                await probe.chat.completions.create(**self._request([{"role": "user", "content": "hi"}], 1, None,
                                                                    max_tokens=1, token_ids=False))
            except openai.APIError as exc:
                raise SamplerInitError(f"sampler: the endpoint refused a request with these sampling parameters "
                                       f"and extra_params: {exc}") from None
        except openai.APIError as exc:
            raise SamplerInitError(f"{where}: a test request failed: {type(exc).__name__}: {exc}") from None

    def _request(self, messages: list[dict[str, Any]], n: int, seed: int | None, *, token_ids: bool,
                 max_tokens: int | None = None) -> dict[str, Any]:
        body = dict(self.config.extra_params)
        if token_ids:
            body["return_token_ids"] = True
        request: dict[str, Any] = dict(model=self.config.model, messages=messages, n=n, extra_body=body)
        for name in ("temperature", "top_p", "max_tokens"):
            if getattr(self.config, name) is not None:
                request[name] = getattr(self.config, name)
        if max_tokens is not None:
            request["max_tokens"] = max_tokens
        if seed is not None:
            request["seed"] = seed
        return request

    async def sample(self, task: SampleTask, lane: Any) -> list[Response]:
        reply = await self.client.chat.completions.create(
            **self._request(task.item["messages"], task.n, task.seed, token_ids=self._token_ids))
        usage = reply.usage
        prompt_tokens = usage.prompt_tokens if usage is not None else None
        responses = []
        for choice in sorted(reply.choices, key=lambda c: c.index):
            ids = getattr(choice, "token_ids", None)
            if ids is not None:
                completion = len(ids)
            else:
                completion = usage.completion_tokens if usage is not None and len(reply.choices) == 1 else None
            responses.append(Response(choice.message.content or "", choice.finish_reason, prompt_tokens, completion))
        return responses

    async def shutdown(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()
