"""Edge input processors of the Qwen3-Omni family (``custom_process_input_func``), client side.

- the thinker -> talker edge is both families' ``thinker2talker`` (``omni_stage_inputs``) (the thinker's prompt ids and
  states, forwarded as they came); the talker stage builds its inputs from them (``talker_requests``);
- ``talker2code2wav``: the talker's frames ``[G, n]``: all of them when the talker has finished
  (``sequential``), or piece by piece as the talker makes them (``async_chunk``:
  ``code2wav_chunks``), each piece a code2wav request of its own whose audio streams on at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_engine.models.omni_stage_inputs import FromFinishedSource
from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecChunks, CodecStream
from omni_engine.pipeline.input_processors import StageInput
from omni_engine.pipeline.listener_pacing import ListenerPacer

if TYPE_CHECKING:
    from omni_engine.outputs import OmniRequestOutput
    from omni_engine.pipeline.playback_clock import PlaybackClock


class TalkerToCode2Wav(FromFinishedSource):
    """Sequential: one code2wav request of all the frames. ``async_chunk`` (``on_output`` is
    called): a request per piece as soon as its frames are known, the rest at the end; with
    ``pacing``, earlier when the request's listener would otherwise wait (``ListenerPacer``)."""

    name = "talker2code2wav"

    def __init__(self, sources: list[int], dst: int, prompt: Any = None, chunks: CodecChunks | None = None,
                 pacing: bool = True) -> None:
        super().__init__(sources, dst, prompt)
        self.chunks, self.pacing = chunks, pacing
        self.clock: PlaybackClock | None = None
        self.stream: CodecStream | None = None

    def follow_playback(self, clock: PlaybackClock) -> None:
        self.clock = clock

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        if self.stream is None:
            paced = self.pacing and self.clock is not None
            self.stream = CodecStream(self.chunks, ListenerPacer(self.clock) if paced else None)
        partial = output.multimodal_output
        if output.finished or "codes_offset" not in partial:
            return []  # the final output's frames are all of them: on_finish
        return [StageInput(p) for p in self.stream.add(partial["codes"], int(partial["codes_offset"]))]

    def input_from(self, received: list[OmniRequestOutput]) -> StageInput:
        return StageInput({"codes": self.final_of(received)["codes"]})

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if self.stream is None:
            return super().on_finish(outputs, text)
        received = outputs.get(self.source) or []
        return [StageInput(p) for p in self.stream.finish(self.final_of(received)["codes"])] if received else []

    def final_of(self, received: list[OmniRequestOutput]) -> dict[str, Any]:
        final = received[-1].multimodal_output
        codes = final.get("codes")
        if codes is None or "codes_offset" in final or getattr(codes, "ndim", 0) != 2:
            raise ValueError(f"stage {self.source}'s final output has no frames [code groups, frames]: it is not "
                             "Qwen3-Omni's talker (engine_args.model_stage: talker)")
        return final


def talker2code2wav(sources: list[int], dst: int, prompt: Any = None, initial_codec_chunk_frames: int = 4,
                    codec_chunk_frames: int = 25, codec_left_context_frames: int = 25,
                    codec_chunk_ramp: bool = True, codec_chunk_pacing: bool = True) -> TalkerToCode2Wav:
    """The edge; the codec chunk sizes as vLLM-Omni's connector ``extra`` names them (the stage's
    ``custom_process_input_args``, or a deploy file's ``connectors:``), whether later pieces ramp
    up to their size, and whether a piece leaves early when its listener would wait (ours:
    ``code2wav_chunks``, ``listener_pacing``; both false is vLLM-Omni's plan)."""
    chunks = CodecChunks(initial_codec_chunk_frames, codec_chunk_frames, codec_left_context_frames,
                         bool(codec_chunk_ramp))
    return TalkerToCode2Wav(sources, dst, prompt, chunks, bool(codec_chunk_pacing))
