"""Let vLLM's Qwen2-VL family import where torchvision cannot.

vLLM's ``qwen2_vl`` model file (which its Qwen2.5-Omni and Qwen3-Omni thinkers import) takes ``smart_resize``
from transformers' torchvision image processor module, whose first lines import torchvision.
transformers ships the same function in its PIL twin of that module (marked there as a copy).
Where torchvision is missing, ``install()`` registers a module under the torchvision module's name
that has that function and nothing else: any other name is an ImportError that says why, so code
that wanted the torchvision processor itself still fails as it would have, only more clearly.
Where torchvision is installed nothing is done.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from omni_engine.models.omni_processor import has_torchvision

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def install() -> bool:
    """Register the stand-in module if torchvision is missing; True when it is (now) in place."""
    if has_torchvision():
        return False
    current = sys.modules.get(TORCHVISION_MODULE)
    if current is not None:
        return getattr(current, "__omni_engine_stand_in__", False)
    import importlib

    pil = importlib.import_module(PIL_MODULE)
    module = types.ModuleType(TORCHVISION_MODULE, __doc__)
    module.smart_resize = pil.smart_resize
    module.__omni_engine_stand_in__ = True

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # introspection (__file__, __path__...) expects AttributeError
            raise AttributeError(name)
        raise ImportError(f"{TORCHVISION_MODULE}.{name} needs torchvision, which is not installed "
                          f"(only smart_resize is available, from {PIL_MODULE})")

    module.__getattr__ = __getattr__
    sys.modules[TORCHVISION_MODULE] = module
    return True
