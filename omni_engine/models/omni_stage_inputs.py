"""Edge input processors both Qwen-Omni families share (``custom_process_input_func``), client side.

- ``FromFinishedSource``: the shape of an edge whose one source's outputs become the next stage's
  input when that source has finished (each family's ``talker2code2wav`` also streams pieces);
- ``thinker2talker`` (vLLM-Omni's name): the thinker's prompt ids and its states
  (``engine_output_type: latent``: embeddings, hidden states, rope positions), forwarded as they
  came, so tensors in shared memory travel on as the same handles, uncopied. Each family's talker
  stage builds its model's inputs from them (its ``talker_requests``). The talker starts when the
  thinker has finished, as vLLM-Omni runs both families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_engine.pipeline.input_processors import StageInput

if TYPE_CHECKING:
    from omni_engine.outputs import OmniRequestOutput


class FromFinishedSource:
    """One source stage; its outputs become one input when it has finished (``inputs_from``)."""

    name = "processor"

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        if len(sources) != 1:
            raise ValueError(f"{self.name} takes one source stage, got {sources}")
        self.source, self.dst = sources[0], dst

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        received = outputs.get(self.source) or []
        return [self.input_from(received)] if received else []

    def input_from(self, received: list[OmniRequestOutput]) -> StageInput:
        raise NotImplementedError


class ThinkerToTalker(FromFinishedSource):
    name = "thinker2talker"

    def input_from(self, received: list[OmniRequestOutput]) -> StageInput:
        states = received[-1].multimodal_output
        if "hidden_states" not in states:
            raise ValueError(f"stage {self.source}'s final output has no states for stage {self.dst} (the "
                             "talker): the thinker stage needs engine_args.engine_output_type: latent")
        prompt_ids = next((o.prompt_token_ids for o in received if o.prompt_token_ids), None)
        prompt = {"thinker_prompt_token_ids": list(prompt_ids or ()),
                  "input_embeds": states["input_embeds"], "hidden_states": states["hidden_states"]}
        if "positions" in states:  # the thinker's rope positions: where an image sits in its grid
            prompt["thinker_positions"] = states["positions"]
        return StageInput(prompt)


def thinker2talker(sources: list[int], dst: int, prompt: Any = None) -> ThinkerToTalker:
    return ThinkerToTalker(sources, dst, prompt)
