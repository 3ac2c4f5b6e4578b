"""The eye GAN's labels, apart from its torch model: the colour-picker stage reads them and
runs no torch (a stage imports only what it runs)."""

from __future__ import annotations

# In the order of the GAN's one-hot input (omniart_eye_generator/eye_generator.py).
EYE_COLOURS: tuple[str, ...] = ("amber", "blue", "brown", "gray", "grayscale", "green", "hazel", "red")
