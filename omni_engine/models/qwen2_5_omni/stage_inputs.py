"""Edge input processors of the Qwen2.5-Omni family (``custom_process_input_func``), client side.

Under ``async_chunk`` the talker starts on the thinker's first reply token (``thinker2talker``'s
``starts_on_states``) and code2wav on the talker's first codes; ``sequential`` starts each stage
when the one before has finished.

- ``thinker2talker`` (vLLM-Omni's name) is both families' (``omni_stage_inputs``): the thinker's
  prompt ids and states, forwarded as they came; the talker stage builds its model's inputs from
  them (``talker_requests``).
- ``talker2code2wav``: the talker's codes and the voice they were made for: all of them when the
  talker has finished (``sequential``), or piece by piece as the talker makes them (``async_chunk``:
  ``code2wav_chunks``), each piece a code2wav request of its own whose audio streams on at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# thinker2talker: configs written before both families shared it name it here (kept importable).
from omni_engine.models.omni_stage_inputs import FromFinishedSource, thinker2talker  # noqa: F401
from omni_engine.models.qwen2_5_omni.code2wav_chunks import CodeStream
from omni_engine.pipeline.input_processors import StageInput

if TYPE_CHECKING:
    from omni_engine.outputs import OmniRequestOutput


class TalkerToCode2Wav(FromFinishedSource):
    """Sequential: one code2wav request of all the codes. ``async_chunk`` (``on_output`` is called):
    a request per piece as soon as its codes and their look-ahead are known, the rest at the end."""

    name = "talker2code2wav"

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        super().__init__(sources, dst, prompt)
        self.stream: CodeStream | None = None

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        if self.stream is None:
            self.stream = CodeStream()
        partial = output.multimodal_output
        if output.finished or "codes_offset" not in partial:
            return []  # the final output's codes are all of them: on_finish
        return [StageInput(p) for p in self.stream.add(partial["codes"], int(partial["codes_offset"]),
                                                         partial.get("voice"))]

    def input_from(self, received: list[OmniRequestOutput]) -> StageInput:
        final = self.final_of(received)
        return StageInput({"codes": final["codes"], "voice": final.get("voice")})

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if self.stream is None:
            return super().on_finish(outputs, text)
        received = outputs.get(self.source) or []
        if not received:
            return []
        final = self.final_of(received)
        return [StageInput(p) for p in self.stream.finish(final["codes"], final.get("voice"))]

    def final_of(self, received: list[OmniRequestOutput]) -> dict[str, Any]:
        final = received[-1].multimodal_output
        if "codes" not in final or "codes_offset" in final:
            raise ValueError(f"stage {self.source}'s final output has no codes: it is not Qwen2.5-Omni's talker "
                             "(engine_args.model_stage: talker)")
        return final


def talker2code2wav(sources: list[int], dst: int, prompt: Any = None) -> TalkerToCode2Wav:
    return TalkerToCode2Wav(sources, dst, prompt)
