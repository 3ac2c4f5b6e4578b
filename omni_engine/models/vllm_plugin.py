"""vLLM's general plugin (entry point ``vllm.general_plugins``): our model classes in vLLM's registry.

vLLM runs general plugins in every process it starts (its EngineCore and workers included, however
they are started), so a model of ours is found wherever vLLM looks it up. Registration is by dotted
path: nothing of vLLM's model code is imported until a config names the architecture.
"""

from __future__ import annotations

# architecture name -> "module:Class"
OUT_OF_TREE_MODELS = {
    "OmniEngineQwen2_5OmniThinker": "omni_engine.models.qwen2_5_omni.vllm_thinker:OmniEngineQwen2_5OmniThinker",
    "OmniEngineQwen2_5OmniTalker": "omni_engine.models.qwen2_5_omni.vllm_talker:OmniEngineQwen2_5OmniTalker",
    "OmniEngineQwen3OmniMoeThinker": "omni_engine.models.qwen3_omni_moe.vllm_thinker:OmniEngineQwen3OmniMoeThinker",
    "OmniEngineQwen3OmniMoeTalker": "omni_engine.models.qwen3_omni_moe.vllm_talker:OmniEngineQwen3OmniMoeTalker",
}


def register() -> None:
    """Register every model of ours that vLLM does not know yet (plugins may run more than once)."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for architecture, path in OUT_OF_TREE_MODELS.items():
        if architecture not in known:
            ModelRegistry.register_model(architecture, path)
