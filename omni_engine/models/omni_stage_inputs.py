"""Edge input processors both Qwen-Omni families share (``custom_process_input_func``), client side.

- ``FromFinishedSource``: the shape of an edge whose one source's outputs become the next stage's
  input when that source has finished (each family's ``talker2code2wav`` also streams pieces);
- ``thinker2talker`` (vLLM-Omni's name): the thinker's prompt ids and its states
  (``engine_output_type: latent``: embeddings, hidden states, rope positions), forwarded as they
  came, so tensors in shared memory travel on as the same handles, uncopied. Each family's talker
  stage builds its model's inputs from them (its ``talker_requests``). The talker starts when the
  thinker has finished, or (``starts_on_states``, under async_chunk) on its first states.
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
    """The thinker's states for the talker: all of them when the thinker has finished, or, with
    ``starts_on_states`` under async_chunk, from the thinker's first reply token on: the prompt's
    rows and the reply's first open the talker's request, each later output's rows are appended
    to it, the final output's rest ends its input (``StageInput.opens_stream`` / ``continues``)."""

    name = "thinker2talker"

    def __init__(self, sources: list[int], dst: int, prompt: Any = None, starts_on_states: bool = False) -> None:
        super().__init__(sources, dst, prompt)
        # read by the orchestrator: the thinker's partial outputs then carry its states
        self.starts_on_states = starts_on_states
        self.prompt_ids: list[int] | None = None
        self.parts: dict[str, list[Any]] = {"input_embeds": [], "hidden_states": [], "positions": []}
        self.rows = 0  # rows received (from position 0)
        self.opened = False

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        states = output.multimodal_output
        if not self.starts_on_states or output.finished or "states_offset" not in states:
            return []  # the final output's states are all of them: on_finish
        if self.prompt_ids is None:
            self.prompt_ids = list(output.prompt_token_ids or ())
        if int(states["states_offset"]) != self.rows:
            raise ValueError(f"stage {self.source} sent states from row {int(states['states_offset'])} for "
                             f"stage {self.dst} after {self.rows} rows (out of order)")
        self.rows += int(states["input_embeds"].shape[0])
        if self.opened:
            return [StageInput(reply_part(states, 0), continues=True)]
        for key, rows in self.parts.items():
            if key in states:
                rows.append(states[key])
        if self.rows <= len(self.prompt_ids):
            return []  # the talker's prompt ends with the reply's first token
        self.opened = True
        parts, self.parts = self.parts, {}
        return [StageInput(self.prompt_of(self.prompt_ids, {k: cat(v) for k, v in parts.items() if v}),
                           opens_stream=True)]

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if not self.opened:
            return super().on_finish(outputs, text)
        received = outputs.get(self.source) or []
        states = self.states_of(received)
        return [StageInput(reply_part(states, self.rows), continues=True, last=True)]

    def input_from(self, received: list[OmniRequestOutput]) -> StageInput:
        prompt_ids = next((o.prompt_token_ids for o in received if o.prompt_token_ids), None)
        return StageInput(self.prompt_of(list(prompt_ids or ()), self.states_of(received)))

    def states_of(self, received: list[OmniRequestOutput]) -> dict[str, Any]:
        states = received[-1].multimodal_output if received else {}
        if "hidden_states" not in states:
            raise ValueError(f"stage {self.source}'s final output has no states for stage {self.dst} (the "
                             "talker): the thinker stage needs engine_args.engine_output_type: latent")
        return states

    @staticmethod
    def prompt_of(prompt_ids: list[int], states: dict[str, Any]) -> dict[str, Any]:
        prompt = {"thinker_prompt_token_ids": prompt_ids,
                  "input_embeds": states["input_embeds"], "hidden_states": states["hidden_states"]}
        if "positions" in states:  # the thinker's rope positions: where an image sits in its grid
            prompt["thinker_positions"] = states["positions"]
        return prompt


def reply_part(states: dict[str, Any], start: int) -> dict[str, Any]:
    """A later part of the reply's states, rows ``start`` on: each reply token's input embedding (what
    Qwen3-Omni's talker reads) and its hidden state (Qwen2.5-Omni's reads their sum)."""
    return {key: states[key][start:] if start else states[key]
            for key in ("input_embeds", "hidden_states") if key in states}


def cat(rows: list[Any]) -> Any:
    """Row blocks as one (one block as it came: a shared-memory handle travels on uncopied)."""
    import torch

    return rows[0] if len(rows) == 1 else torch.cat([torch.as_tensor(r) for r in rows])


def thinker2talker(sources: list[int], dst: int, prompt: Any = None, starts_on_states: bool = False) -> ThinkerToTalker:
    """The edge; ``starts_on_states`` (the stage's ``custom_process_input_args``): under async_chunk
    the talker starts on the thinker's first states (its stage's adapter must take input in parts)."""
    return ThinkerToTalker(sources, dst, prompt, starts_on_states)
