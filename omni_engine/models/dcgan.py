"""The two DCGAN generators that PyPI packages ship, defined here so their weights load on CPU.

* ``omniart-eye-generator==0.1``: a conditional DCGAN, z [100] + one-hot eye colour [8]
  -> RGB 128x128. The package cannot be imported on CPU (it loads its weights with
  ``torch.load`` and no ``map_location`` at import), so its architecture is copied
  from its ``generator.py`` and the weights are loaded with ``map_location="cpu"``.
* ``gan-face-generate==1.1.1``: PyTorch's DCGAN tutorial generator trained on
  DigiFace1M, z [100] -> RGB 64x64 (``weights.tar``, key ``netG_state_dict``).

Both modules keep the upstream layer layout (``main`` as an ``nn.Sequential``)
so that the upstream state dicts load with ``strict=True``: a mismatch fails at
load instead of producing noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from omni_engine.models.gan_labels import EYE_COLOURS

LATENT_SIZE = 100
EYE_WEIGHTS = "generator_model_state.pth"
FACE_WEIGHTS = "weights.tar"


def _up(c_in: int, c_out: int, stride: int = 2, padding: int = 1) -> list[nn.Module]:
    """One DCGAN block: transposed conv (x2 spatial), batch norm, ReLU."""
    return [nn.ConvTranspose2d(c_in, c_out, 4, stride, padding, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True)]


class EyeGenerator(nn.Module):
    """Conditional DCGAN: (z [B,100], one-hot colour [B,8]) -> [B,3,128,128] in [-1, 1]."""

    def __init__(self, features: int = 64) -> None:
        super().__init__()
        f = features
        first = _up(LATENT_SIZE + len(EYE_COLOURS), f * 16, stride=1, padding=0)
        # Dropout sits after the first block upstream (index 3); kept so the indices match the state dict.
        self.main = nn.Sequential(*first, nn.Dropout(0.2), *_up(f * 16, f * 8), *_up(f * 8, f * 4),
                                  *_up(f * 4, f * 2), *_up(f * 2, f),
                                  nn.ConvTranspose2d(f, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.cat([noise.reshape(noise.shape[0], -1), labels], 1)
        return self.main(x.reshape(x.shape[0], -1, 1, 1))


class FaceGenerator(nn.Module):
    """Unconditional DCGAN: z [B,100,1,1] -> [B,3,64,64] in [-1, 1]."""

    def __init__(self, features: int = 64) -> None:
        super().__init__()
        f = features
        self.main = nn.Sequential(*_up(LATENT_SIZE, f * 8, stride=1, padding=0), *_up(f * 8, f * 4),
                                  *_up(f * 4, f * 2), *_up(f * 2, f),
                                  nn.ConvTranspose2d(f, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.main(noise.reshape(noise.shape[0], LATENT_SIZE, 1, 1))


@dataclass(frozen=True, slots=True)
class LoadedGan:
    """A generator in eval mode and what callers need to know about it."""

    module: nn.Module
    height: int
    width: int
    labels: tuple[str, ...]  # empty: unconditional


def _weights_file(model: str | Path, file_name: str, recipe: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / file_name
    if not path.is_file():
        raise ValueError(f"engine_args.model: no {file_name} at {path} (run `omni-engine prepare-model {recipe}`, "
                         f"or give the directory holding {file_name})")
    return path


def load_eye_generator(model: str | Path) -> LoadedGan:
    """The eye GAN from a directory holding ``generator_model_state.pth`` (or that file)."""
    module = EyeGenerator()
    state = torch.load(_weights_file(model, EYE_WEIGHTS, "gan-eyes"), map_location="cpu", weights_only=True)
    module.load_state_dict(state, strict=True)
    return LoadedGan(module.eval(), 128, 128, EYE_COLOURS)


def load_face_generator(model: str | Path) -> LoadedGan:
    """The face GAN from a directory holding ``weights.tar`` (or that file)."""
    module = FaceGenerator()
    checkpoint = torch.load(_weights_file(model, FACE_WEIGHTS, "gan-faces"), map_location="cpu", weights_only=True)
    module.load_state_dict(checkpoint["netG_state_dict"], strict=True)
    return LoadedGan(module.eval(), 64, 64, ())
