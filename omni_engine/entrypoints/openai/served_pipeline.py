"""The served pipeline as the OpenAI routes see it: one module every route family builds on.

A route family (``speech``, ``chat_audio``, ``transcription``, ``images``, ``realtime``,
``speech_stream``, ``rl_routes``, ``weight_versions``) imports this module and none of its
siblings. What is here is what more than one of them needs:

* the ``MultiStageEngineClient`` behind a request (``engine_client``), the model names it serves
  (``served_names``) and the OpenAI 404 for any other (``check_model``);
* the stage a route enters at or ends at (``audio_stage_id``, ``speech_to_text_stage``);
* the per-stage params a request builds (``stage_params``, with the voice for the stages that speak
  (``voice_stages``), ``with_stage_overrides`` for a request's ``sampling_params_list``,
  ``speech_params``, ``speech_dict``) and a chat request rendered by vLLM's own chat serving
  (``chat_engine_input``);
* speech through the speech stage alone (``speak``);
* the OpenAI-shaped error (``error_response``) and ``RequestRefused``, which carries one out of a
  helper to the route that answers it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from fastapi.responses import JSONResponse, Response
from starlette.requests import HTTPConnection
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from omni_engine.params import SpeechParams, merged_params, to_sampling_params

# A speech stage that reports no sample rate is assumed to speak at this one (eSpeak's, Piper's).
DEFAULT_SAMPLE_RATE = 22050


def error_response(message: str, status: int = 400, param: str | None = None,
                   err_type: str = "BadRequestError") -> JSONResponse:
    """An error as OpenAI's API answers it: ``{"error": {message, type, param, code}}``."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status)


class RequestRefused(Exception):
    """A request refused before (or while) it reaches the pipeline; ``response`` is the HTTP answer."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


# ------------------------------------------------------------ the client
def engine_client(connection: HTTPConnection) -> Any:
    """The ``MultiStageEngineClient`` serving ``connection`` (an HTTP request or a WebSocket)."""
    return connection.app.state.engine_client


def served_names(client: Any) -> list[str]:
    """The model names this server answers to (``--served-model-name``), in order."""
    name = getattr(client.model_config, "served_model_name", None)
    return list(name) if isinstance(name, (list, tuple)) else [name] if name else []


def unserved_model(client: Any, model: str | None) -> list[str] | None:
    """The names this server serves when ``model`` is none of them; None when it is (or none was
    named, or the server has no names): the one model check of every route and socket."""
    names = served_names(client)
    return names if model and names and model not in names else None


def lora_request_of(connection: HTTPConnection, model: str | None) -> Any:
    """The LoRA adapter a request's ``model`` names (vLLM's ``--lora-modules`` or a loaded one: its
    ``LoRARequest``); None for the base model. vLLM's chat route resolves its own the same way."""
    models = getattr(connection.app.state, "openai_serving_models", None)
    return models.lora_requests.get(model) if models is not None and model else None


def check_model(client: Any, model: str | None) -> JSONResponse | None:
    """OpenAI's 404 for a ``model`` this server does not serve; None when it does (or none was named)."""
    if unserved_model(client, model) is not None:
        return error_response(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")
    return None


# ------------------------------------------------------------ its stages
def audio_stage_id(client: Any) -> int | None:
    """The pipeline's speech stage: the first final stage with audio output."""
    return client.stage_for_output("audio")


def text_speech_refusal(client: Any, sid: int) -> str | None:
    """Why text cannot be spoken by the speech stage ``sid`` alone (None: it can): a stage whose READY
    info says it speaks from ``input_kind: codes`` (Qwen-Omni's code2wav) speaks its talker's codes."""
    entry = client.text_entry_stage(sid)
    if client.stage_info(entry).get("input_kind", "text") == "text":
        return None
    return (f"this pipeline's speech stage (stage {sid}) speaks its talker's codes, not text: the model answers "
            "in speech through /v1/chat/completions with modalities [\"text\", \"audio\"]")


def speech_to_text_stage(client: Any) -> int | None:
    """The pipeline's speech-to-text stage (READY info ``input_modalities`` has ``audio``)."""
    for sid in client.stage_ids():
        if "audio" in client.stage_info(sid).get("input_modalities", ()):
            return sid
    return None


def text_stage_hears(client: Any) -> bool:
    """Whether the text stage's model takes audio in its prompts (Qwen-Omni's thinker)."""
    sid = client.text_stage_id
    return sid is not None and "audio" in client.stage_info(sid).get("prompt_modalities", ())


# ------------------------------------------------ the params a request builds
def stage_params(client: Any, sid: int, params: Any, others: Any = None, voice: str | None = None) -> dict[int, Any]:
    """Params by stage id: ``params`` for ``sid``, ``others`` for the text stage, and ``voice`` in
    the ``extra_args`` of every llm stage that speaks (its READY info lists ``voices``: a talker,
    whose codes depend on the voice), over that stage's defaults."""
    out = {sid: params}
    text_sid = client.text_stage_id
    if others is not None and text_sid is not None:
        out[text_sid] = others
    for vsid in voice_stages(client) if voice is not None else ():
        if vsid not in out and client.stage_info(vsid).get("engine") == "vllm":
            out[vsid] = merged_params(client.stage_default_params(vsid), {"extra_args": {"voice": voice}})
    return out


def with_stage_overrides(client: Any, params: dict[int, Any], overrides: Any) -> dict[int, Any]:
    """``params`` with a request's ``sampling_params_list`` (vLLM-Omni's field: one entry per stage in
    stage order, null to keep a stage's) merged in, field by field, over what the request set for
    that stage or else the stage's defaults; ``RequestRefused`` names the entry at fault."""
    if overrides is None:
        return params
    order = client.stage_ids()
    if not isinstance(overrides, list) or len(overrides) > len(order):
        raise RequestRefused(error_response(f"sampling_params_list must be a list of at most {len(order)} "
                                            "objects or nulls, one per stage in stage order",
                                            param="sampling_params_list"))
    out = dict(params)
    for index, (sid, entry) in enumerate(zip(order, overrides)):
        if entry is None:
            continue
        where = f"sampling_params_list[{index}]"
        if not isinstance(entry, dict):
            raise RequestRefused(error_response(f"{where} (stage {sid}) must be an object or null, got "
                                                f"{type(entry).__name__}", param=where))
        base = out.get(sid)
        if isinstance(base, SamplingParams):
            base = msgspec.structs.asdict(base)
        merged = merged_params(base if isinstance(base, dict) else client.stage_default_params(sid), entry)
        if client.stage_info(sid).get("engine") == "vllm":
            try:
                merged = to_sampling_params(merged)
            except (TypeError, ValueError) as exc:
                raise RequestRefused(error_response(f"{where} (stage {sid}): {exc}", param=where)) from None
            if sid == client.text_stage_id:
                merged.output_kind = RequestOutputKind.DELTA  # the route streams the text stage's deltas
        out[sid] = merged
    return out


def voice_stages(client: Any) -> list[int]:
    """The stages that speak in voices (their READY info lists ``voices``)."""
    return [sid for sid in client.stage_ids() if client.stage_info(sid).get("voices")]


def voice_accepted(info: dict[str, Any], voice: str) -> bool:
    """Whether the speech stage described by ``info`` (its READY engine info) takes ``voice``."""
    voice = voice.lower()
    base, _, variant = voice.partition("+")
    return voice in info["voice_map"] or (base in info.get("voices", ()) and
                                          (not variant or variant in info.get("variants", ())))


def speech_params(client: Any, sid: int, voice: Any, speed: Any) -> SpeechParams:
    """Checked speech params: ``ValueError`` naming a bad speed, or a voice the speech stage does not
    accept (its OpenAI names, its engine's codes, ``code+variant``; a model's speakers, in any case),
    pointing at the list. ``voice`` None: the stage's default voice."""
    info = client.stage_info(sid)
    params = SpeechParams(voice=info.get("default_voice", "en") if voice is None else voice, speed=speed)
    params.validate()
    if "voice_map" in info and not voice_accepted(info, params.voice):
        raise ValueError(f"unknown voice {params.voice!r}; GET /v1/audio/voices lists the accepted voices "
                         f"(OpenAI's: {', '.join(sorted(info['voice_map']))})")
    if "voice_map" not in info and info.get("voices"):
        named = {v.lower(): v for v in info["voices"]}.get(params.voice.lower())
        if named is None:
            raise ValueError(f"unknown voice {params.voice!r}; GET /v1/audio/voices lists the accepted voices "
                             f"(this model's: {', '.join(info['voices'])})")
        params = SpeechParams(voice=named, speed=params.speed, pitch=params.pitch)
    return params


def speech_dict(params: SpeechParams) -> dict[str, Any]:
    """Checked speech params as the speech stage takes them."""
    return {"voice": params.voice, "speed": float(params.speed)}


async def chat_engine_input(client: Any, connection: HTTPConnection,
                            request: ChatCompletionRequest) -> tuple[Any, SamplingParams, int]:
    """The rendered prompt, its sampling parameters (DELTA) and its length, as vLLM's chat serving makes
    them for ``request``; ``RequestRefused`` with vLLM's error where it refuses the request."""
    serving = connection.app.state.openai_serving_chat
    rendered = await serving.render_chat_request(request)
    if isinstance(rendered, ErrorResponse):
        raise RequestRefused(JSONResponse(rendered.model_dump(), status_code=rendered.error.code))
    _conversation, engine_inputs = rendered
    engine_input = engine_inputs[0]
    prompt_len = len(engine_input.get("prompt_token_ids") or [])
    try:
        max_tokens = get_max_tokens(
            client.model_config.max_model_len,
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens,
            prompt_len, serving.default_sampling_params, serving.override_max_tokens,
            truncate_prompt_tokens=request.truncate_prompt_tokens)
        sampling_params = request.to_sampling_params(max_tokens, serving.default_sampling_params)
    except ValueError as exc:
        raise RequestRefused(error_response(str(exc))) from None
    sampling_params.output_kind = RequestOutputKind.DELTA  # sentences reach the speech stage as they end
    try:
        client.validate_request(engine_input, sampling_params, "validate")
    except (VLLMValidationError, ValueError) as exc:
        raise RequestRefused(error_response(str(exc))) from None
    return engine_input, sampling_params, prompt_len


# ------------------------------------------------------------ speech out
async def speak(client: Any, sid: int, text: str, params: dict[str, Any], request_id: str,
                deadline: float | None = None) -> tuple[np.ndarray, int]:
    """``text`` spoken by the speech stage (with the stages before it that take text, e.g. a
    phonemizer, but not the LLM): the whole waveform and its sample rate. ``deadline``: when its
    listener needs it (``time.time()`` seconds; default now)."""
    chunks, rate = [], DEFAULT_SAMPLE_RATE
    entry = client.text_entry_stage(sid)
    async for out in client.generate(text, stage_params(client, sid, params), request_id, entry_stage_id=entry,
                                     final_stage_id=sid, deadline=deadline):
        mm = out.multimodal_output
        if mm and mm.get("audio") is not None:
            chunks.append(np.asarray(mm["audio"], dtype=np.float32).copy())
            rate = int(mm.get("sample_rate", rate))
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)), rate
