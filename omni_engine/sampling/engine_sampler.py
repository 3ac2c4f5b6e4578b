"""``EngineSampler``: a ``MultiStageEngineClient`` in this process, any pipeline.

Prompts are rendered the way vLLM's OpenAI server renders a chat request --
the text stage's own renderer (chat template, tokenizer, special tokens) --
and sampling starts from the same defaults (the model's generation config,
then the stage's ``default_sampling_params``), so its greedy answers are the
server's. ``n`` answers are one request (``SamplingParams(n=...)``: one prompt
prefill shared by the n sequences); each item and round has its own seed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
from pathlib import Path
from typing import Any

import msgspec

from omni_engine.sampling.base import BaseSampler, SamplerInitError
from omni_engine.sampling.config import SamplerConfig, resolve_path
from omni_engine.sampling.items import Response, SampleTask


class EngineSampler(BaseSampler):
    """Samples through a pipeline started in this process (or a ``client`` it is given, which it does not own)."""

    kind = "engine"

    def __init__(self, config: SamplerConfig, *, client: Any = None, base_dir: str | Path = ".") -> None:
        super().__init__(config)
        self._base_dir = Path(base_dir)
        self.client = client
        self._owns_client = client is None
        self._renderer: Any = None
        self._model_config: Any = None
        self._chat_params: Any = None
        self._tok_params: Any = None
        self._defaults: dict[str, Any] = {}
        self._text_stage_id = 0
        self._ids = itertools.count()
        # Rendered prompts of recent items: an item's rounds follow each other closely.
        self._prompts: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()
        self._run = f"sample-{os.getpid()}"

    def pipeline_path(self) -> Path:
        return resolve_path(self.config.pipeline or "", self._base_dir)

    async def initialize(self) -> None:
        from omni_engine.config import ConfigError
        from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
        from omni_engine.entrypoints.openai.engine_config import build_text_stage_config, text_stage_of

        await super().initialize()

        if self.client is None:
            try:
                self.client = await MultiStageEngineClient.from_config(self.pipeline_path(), text_stage=True)
            except (ConfigError, ValueError) as exc:  # ValueError: no llm stage to sample from
                raise SamplerInitError(f"sampler.pipeline: {exc}") from exc
        try:
            text_stage = text_stage_of(self.client.config)
        except ValueError as exc:
            raise SamplerInitError(f"sampler.pipeline: {exc}") from None
        if self.client.renderer is not None:
            self._model_config, self._renderer = self.client.model_config, self.client.renderer
        else:  # a client given without its text stage's vLLM objects: the sampler loads its own
            text = await asyncio.to_thread(build_text_stage_config, text_stage)
            self._model_config, self._renderer = text.model_config, text.renderer
        self._text_stage_id = text_stage.stage_id
        self._chat_params, self._tok_params = self._render_params()
        # vLLM's server starts from the model's generation config; then the stage's defaults, then ours.
        self._defaults = {**self._model_config.get_diff_sampling_param(),
                          **text_stage.default_sampling_params, **self.config.sampling_params()}
        self._check_params()

    def _render_params(self) -> tuple[Any, Any]:
        """The chat and tokenization params vLLM's server builds for a chat request with
        default options (generation prompt on, the model's own template) and our max_tokens."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="-", messages=[{"role": "user", "content": "-"}],
                                        max_tokens=self.config.max_tokens)
        return request.build_chat_params(None, "auto"), request.build_tok_params(self._model_config)

    def _check_params(self) -> None:
        try:
            self.sampling_params(1, 0)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation errors are of several kinds
            raise SamplerInitError(f"sampler.extra_params / sampling fields: not valid vLLM SamplingParams: "
                                   f"{exc}") from None

    def sampling_params(self, n: int, seed: int | None) -> Any:
        """The ``SamplingParams`` of one request: the model's generation config, the stage's
        ``default_sampling_params``, the sampler's fields, then ``n`` and the seed."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = {**self._defaults, "n": n, "output_kind": RequestOutputKind.FINAL_ONLY}
        if seed is not None:
            params["seed"] = seed
        return SamplingParams(**params)

    async def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt token ids vLLM's server would build for ``messages``."""
        _, prompts = await self._renderer.render_chat_async([messages], self._chat_params, self._tok_params)
        return list(prompts[0]["prompt_token_ids"])

    async def _prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        key = msgspec.json.encode(messages)
        ids = self._prompts.get(key)
        if ids is None:
            ids = self._prompts[key] = await self.render(messages)
            if len(self._prompts) > 4 * self.config.concurrency:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return ids

    async def sample(self, task: SampleTask, lane: Any) -> list[Response]:
        prompt_ids = await self._prompt_ids(task.item["messages"])
        params = self.sampling_params(task.n, task.seed)
        request_id = f"{self._run}-{task.item_id}-r{task.round}-{next(self._ids)}"
        final = None
        async for output in self.client.generate({"prompt_token_ids": prompt_ids}, params, request_id,
                                                 final_stage_id=self._text_stage_id):
            if output.stage_id == self._text_stage_id:
                final = output
        if final is None or not final.finished:
            raise RuntimeError(f"request {request_id}: the pipeline ended without a final text output")
        return [Response(c.text, c.finish_reason, len(prompt_ids), len(c.token_ids)) for c in final.outputs]

    def model_name(self) -> str:
        if self.client is not None and getattr(self.client, "model_config", None) is not None:
            return str(self._model_config.served_model_name or self._model_config.model)
        return super().model_name()

    async def shutdown(self) -> None:
        client, self.client = self.client, None
        if client is not None and self._owns_client:
            await client.shutdown_async()
