"""Qwen2.5-Omni (thinker -> talker -> code2wav): the family's checkpoint recipe, its vLLM models
and the input processing between its stages."""
