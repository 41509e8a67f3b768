"""Load a checkpoint (GGUF file, local Hugging Face folder, or hub id) with its tokenizer, via transformers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from actors.model import generic
from actors.model.backends import NATIVE_ARCHITECTURES, Backend, BackendChoice, BackendPlan, Unsupported, \
    choose_backend
from actors.model.convert import MANIFEST
from actors.model.gguf_tensors import StoredTensors, source_of
from actors.model.tokenize import encode_prompt
from actors.model.qlinear import ACTIVATIONS, Activations
from actors.model.weights import WEIGHT_MODES, WeightMode
from actors.start_phases import phase

# model_type -> feed-forward kind of the hand-written (native) path; other decoder-only models run on the generic
# path (actors/model/backends.py), and what neither runs is refused before weights are read.
SUPPORTED_ARCHITECTURES = NATIVE_ARCHITECTURES
GENERIC_SUMMARY = "any decoder-only transformers model with full/sliding attention through its attention interface"

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded: missing file, unreachable hub, or unsupported architecture."""


class UnsupportedArchitecture(ModelLoadError):
    pass


@dataclass
class LoadedModel:
    """A checkpoint in memory: the transformers model (weights and reference forward) and its tokenizer.

    `hf_model` is None when only the metadata was loaded (load_metadata): a driver of remote shards.
    """

    source: str
    config: PretrainedConfig
    hf_model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    generation_config: GenerationConfig | None = None  # set by load_metadata; else the hf_model's
    weights: WeightMode = "dequantized"  # how runners compute its linear maps by default (actors/model/weights.py)
    activations: Activations = "int8"  # how our CPU int4 kernel takes their inputs by default (actors/model/qlinear.py)
    stored: StoredTensors | None = None  # the GGUF file's quantized tensors, for `weights: stored`
    # the path its runners take (actors/model/backends.py) and why, as the load log and `specfleet generate` say it
    plan: BackendPlan = field(default_factory=lambda: BackendPlan("native", "hand-written layers"))
    prepared: dict = field(default_factory=dict, repr=False)  # projections built for runners, shared by them

    @property
    def device(self) -> torch.device | None:
        """Where the weights are (None without weights)."""
        return None if self.hf_model is None else next(self.hf_model.parameters()).device

    @property
    def backend(self) -> Backend:
        return self.plan.backend

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_model_len(self) -> int:
        return int(self.config.max_position_embeddings)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt by the one prompt-encoding rule (actors/model/tokenize.py, encode_prompt)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids from the generation config and the tokenizer."""
        ids: set[int] = set()
        gen = self.generation_config or getattr(self.hf_model, "generation_config", None)
        for value in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(value)
        return frozenset(ids)


def _looks_like_path(source: str) -> bool:
    """A hub id is `org/name`; anything absolute, relative-dotted, home-based or .gguf is a path."""
    return source.endswith(".gguf") or source.startswith((".", "/", "~"))


def _location(source: str) -> tuple[str, dict]:
    """Map a source to transformers' (pretrained_model_name_or_path, extra kwargs)."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{source}: a model file must be GGUF (.gguf); a safetensors model is a folder")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    if _looks_like_path(source):
        raise ModelLoadError(f"model not found: {source} (no such file or folder)")
    return source, {}  # a hub id


def _pretrained(cls, source: str, failed: str, **extra):  # noqa: ANN001 - a transformers Auto class
    """`cls.from_pretrained` of `source` (a folder, a GGUF file or a hub id); ModelLoadError saying `failed` if it cannot
    be read."""
    where, kwargs = _location(source)
    try:
        return cls.from_pretrained(where, **kwargs, **extra)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{failed}: {e}") from None


def load_model_config(source: str, backend: BackendChoice = "auto") -> PretrainedConfig:
    """Read only the model's config, refusing a model no path runs (under `backend`) with the reason in one line."""
    return _config_and_plan(source, backend)[0]


def _config_and_plan(source: str, backend: BackendChoice) -> tuple[PretrainedConfig, BackendPlan]:
    config = _pretrained(AutoConfig, source, f"cannot read the config of {source}")
    try:
        return config, choose_backend(config, backend)
    except Unsupported as e:
        native = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedArchitecture(f"unsupported architecture {config.model_type!r}: {e} "
                                      f"(native: {native}; generic: {GENERIC_SUMMARY})") from None


def load_model(source: str, dtype: str = "fp32", device: torch.device | str = "cpu",
               weights: WeightMode = "dequantized", activations: Activations = "int8",
               backend: BackendChoice = "auto") -> LoadedModel:
    """Load weights and tokenizer of `source` (a GGUF file, a local folder, or a hub id) in `dtype` onto `device`
    ("meta" allocates nothing: for checking where tensors go). `weights` is how runners compute its linear maps
    (actors/model/weights.py), `activations` how our CPU int4 kernel takes their inputs (actors/model/qlinear.py);
    `stored` reads a GGUF source's quantized tensors, from the file itself or from the file a converted folder names
    (actors/model/convert.py). `backend` picks the path (actors/model/backends.py): the generic one runs the
    checkpoint's dense weights (a GGUF file's dequantized by transformers' loader), so `stored` reads no blocks
    there."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unsupported weights {weights!r}; supported: {', '.join(WEIGHT_MODES)}")
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activations {activations!r}; supported: {', '.join(ACTIVATIONS)}")
    with phase("tokenizer"):
        config, plan = _config_and_plan(source, backend)
        log.info("%s: %s", source, plan.describe())
        tokenizer = _pretrained(AutoTokenizer, source, f"cannot load {source}")
    with phase("weights"):  # safetensors are memory-mapped: their pages are read as the layers use them
        model = _pretrained(AutoModelForCausalLM, source, f"cannot load {source}", dtype=DTYPES[dtype])
    model.eval().requires_grad_(False)
    if torch.device(device) != torch.device("cpu"):
        model.to(device)
    if plan.backend == "generic":
        generic.adopt(model)  # its attention through ours (actors/model/generic.py)
    with phase("weights"):
        stored = _stored_tensors(source, config) if weights == "stored" and plan.backend == "native" else None
    return LoadedModel(source=source, config=config, hf_model=model, tokenizer=tokenizer, dtype=DTYPES[dtype],
                       weights=weights, activations=activations, stored=stored, plan=plan)


def _stored_tensors(source: str, config: PretrainedConfig) -> StoredTensors | None:
    """The GGUF tensors behind `source`: the file itself, or the one a converted folder was made from (None for
    a safetensors model: its weights are computed as they are stored, dense)."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        gguf = source_of(path)
        if gguf is None:
            raise ModelLoadError(f"{source} was converted from a GGUF file that is gone or changed since: "
                                 "`weights: stored` computes on that file (or use `weights: dequantized`)")
        path = gguf
    if path.suffix != ".gguf" or not path.is_file():
        return None
    return StoredTensors(path, config.num_attention_heads, config.num_key_value_heads)


def load_metadata(source: str, dtype: str = "fp32", backend: BackendChoice = "auto") -> LoadedModel:
    """Config, tokenizer and generation config of `source`, no weights (`hf_model` None): what a driver needs."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    config, plan = _config_and_plan(source, backend)
    tokenizer = _pretrained(AutoTokenizer, source, f"cannot load the tokenizer of {source}")
    where, kwargs = _location(source)
    try:
        generation = GenerationConfig.from_pretrained(where, **kwargs)
    except OSError:  # no generation_config.json: the model config's token ids stand in, as transformers does
        generation = GenerationConfig.from_model_config(config)
    return LoadedModel(source=source, config=config, hf_model=None, tokenizer=tokenizer, dtype=DTYPES[dtype],
                       generation_config=generation, plan=plan)
