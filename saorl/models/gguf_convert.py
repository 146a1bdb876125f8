"""One GGUF file made into a plain Hugging Face directory, every weight taken from the file.

The file is read first with the ``gguf`` package (:func:`inspect_gguf`): an empty file, one that
is not GGUF, or one cut short (a partial download or copy) is named as such, in one paragraph,
before transformers sees it. transformers' GGUF loader then dequantises it into a float32 causal
LM; its loading report must list no parameter of the architecture as missing or of another shape
(a GGUF without some tensors would otherwise load with those weights "newly initialized", i.e.
random, and be cached as a good model): such a file fails in one paragraph naming the tensors it
lacks. Tied embeddings are not missing. The tokenizer is built from the file's ``tokenizer.ggml.*``
metadata; any failure to build it, a Rust panic of ``tokenizers`` included (pyo3's
``PanicException`` derives from ``BaseException``), is one paragraph naming the metadata, with no
traceback. The directory is built in a hidden temporary sibling named with this process's pid,
its manifest written last (:mod:`saorl.models.cache_manifest`), then renamed into place.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from saorl.atomic import fsync_path, readable_as_umask_allows
from saorl.models.cache_dir import ModelSourceError, cache_failure, failure_errno, new_temp, say
from saorl.models.cache_manifest import MARKER, forget, write_manifest

GGUF_MAGIC = b"GGUF"
_LAYER = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?P<rest>.+)$")


def inspect_gguf(gguf_file: Path, label: str) -> int:
    """The number of weights the GGUF file ``gguf_file`` holds; :class:`ModelSourceError` naming an
    empty, foreign or truncated file."""
    size = gguf_file.stat().st_size
    name = gguf_file.name
    if size == 0:
        raise ModelSourceError(f"{label}: the GGUF file {gguf_file} is empty (0 bytes): a download or copy "
                               "that never wrote it. Fetch or copy the file again")
    with open(gguf_file, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelSourceError(f"{label}: {gguf_file} is not a GGUF file (it starts with {head!r}, not "
                               f"b'GGUF'; {size:,} bytes). Give a .gguf model file, as llama.cpp writes it")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_file))
        ends = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        weights = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:
        raise ModelSourceError(
            f"{label}: the GGUF file {name} is truncated or damaged: it is {size:,} bytes and its header or "
            f"tensors cannot be read past that ({_short(e)}). A download or copy that stopped early leaves "
            "such a file: fetch or copy it again") from None
    if ends > size or not reader.tensors:
        raise ModelSourceError(f"{label}: the GGUF file {name} is truncated: its tensors end at byte "
                               f"{ends:,} but the file has {size:,}. Fetch or copy it again")
    return weights


def convert_gguf(gguf_file: Path, out: Path, *, label: str, source: dict) -> None:
    """Dequantise ``gguf_file`` into the cache entry ``out`` (absent), manifest last, atomically."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(
            f"{label}: reading a GGUF file needs the `gguf` package, which is not installed in this "
            f"environment ({sys.executable}): `pip install gguf` (saorl's own install brings it: "
            "`pip install -e .`), then run again")
    inspect_gguf(gguf_file, label)
    mb = gguf_file.stat().st_size / 1e6
    say(f"{label}: converting the GGUF file {gguf_file.name} ({mb:.1f} MB) into a float32 "
        f"Hugging Face directory at {out} (once; about 20-60 s for a 135M model)")
    t0 = time.monotonic()
    try:
        with _entry_dir(out) as tmp:
            model, tokenizer = _load(gguf_file, label)
            say(f"{label}: dequantised {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
                f"({type(model).__name__}) in {time.monotonic() - t0:.0f}s, every one from the file; saving")
            model = _plain(model)
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            del model
            _portable(tmp)
            from transformers import __version__

            info = {**source, "transformers": __version__, "converted_s": round(time.monotonic() - t0, 1)}
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
            try:
                write_manifest(tmp, source)  # last
            except ValueError as e:  # an entry without weights, config or tokenizer is never blessed
                raise ModelSourceError(f"{label}: converting {gguf_file.name} did not give a whole model: "
                                       f"{e}") from None
    except ModelSourceError:
        raise
    except Exception as e:
        code = failure_errno(e)
        if code is None and not isinstance(e, OSError):
            raise
        raise cache_failure(code, label, detail=_short(e)) from None
    forget(out)
    say(f"{label}: converted in {time.monotonic() - t0:.0f}s; later runs use {out} as it is")


@contextlib.contextmanager
def _entry_dir(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` (``.NAME.tmp-<pid>-*``), renamed to ``out`` on success and
    removed on any failure; ``out`` must not exist."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp(out)
    try:
        yield tmp
        readable_as_umask_allows(tmp)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load(gguf_file: Path, label: str):
    """The GGUF's model (every parameter from the file) and tokenizer; the tokenizer first (a second,
    where the model takes 20-60 s to dequantise), so malformed metadata fails at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    try:  # the metadata alone (no tensor read): an architecture transformers cannot load is named first
        load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelSourceError(_unsupported(e, label, gguf_file)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise ModelSourceError(
            f"{label}: the tokenizer metadata of the GGUF file {gguf_file.name} (its tokenizer.ggml.* "
            f"fields: vocabulary, merges, special token ids) is malformed: no tokenizer can be built from it "
            f"({type(e).__name__}: {_short(e)}). The file is damaged or was written by a broken converter: "
            "fetch it again, or convert the model to a Hugging Face directory (config.json + safetensors "
            "+ tokenizer) elsewhere and give that directory") from None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report's table: saorl says what matters in one paragraph
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32, output_loading_info=True)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelSourceError(_unsupported(e, label, gguf_file)) from None
    finally:
        hf_logging.set_verbosity(level)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        raise ModelSourceError(_incomplete(label, gguf_file, type(model).__name__, missing, mismatched,
                                           len(dict(model.named_parameters()))))
    return model, tokenizer


def _incomplete(label: str, gguf_file: Path, arch: str, missing: list[str], mismatched: list[str],
                total: int) -> str:
    lacks = f"lacks {len(missing)} of the {total} tensors of {arch}: {_group(missing)}" if missing else ""
    other = f"holds {len(mismatched)} of another shape: {_group(mismatched)}" if mismatched else ""
    return (f"{label}: the GGUF file {gguf_file.name} {'; it '.join(x for x in (lacks, other) if x)}. "
            "transformers would fill them with random numbers (\"newly initialized\"), so saorl does not "
            "convert it: the file is incomplete (a tensor dropped by a rewrite or a broken converter) or its "
            "metadata (block_count, sizes) does not match its tensors. Get a complete copy of the model")


def _group(keys: list[str]) -> str:
    """``model.layers.29.{input_layernorm.weight, ...}``: the keys of one layer together."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        m = _LAYER.match(k)
        groups.setdefault(m["layer"] if m else "", []).append(m["rest"] if m else k)
    parts = [f"{layer}.{{{', '.join(rest)}}}" if layer else ", ".join(rest) for layer, rest in groups.items()]
    return "; ".join(parts[:6]) + (f"; and {len(parts) - 6} more layers" if len(parts) > 6 else "")


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


def _unsupported(e: BaseException, label: str, gguf_file: Path) -> str:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    return (f"{label}: transformers cannot dequantise the GGUF file {gguf_file.name} ({_short(e, 300)}). "
            f"Its GGUF loader reads the architectures {archs}, with their tokenizers; for another one "
            "convert the model to a Hugging Face directory (config.json + safetensors + tokenizer) elsewhere "
            "and give that directory")


def _short(e: BaseException, n: int = 200) -> str:
    return " ".join(str(e).split())[:n] or type(e).__name__
