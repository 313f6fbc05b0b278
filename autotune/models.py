"""Which model to tune: built-in configs, local directories and Hub ids, resolved to a :class:`ModelSpec`.

autotune never downloads weights. A probe builds the model from its *config* with random weights,
because weights change neither speed nor memory. So a model is fully described by its config dict,
which is what :class:`ModelSpec` carries (as JSON) from the CLI parent to each probe process.

Three sources, tried in this order by :func:`resolve_model`:

* ``builtin``: a name from :data:`BUILTIN_MODELS` (case-insensitive), or the Hub id of one of them
  (``EleutherAI/polyglot-ko-1.3b``). The config is bundled in ``autotune/model_configs/`` and
  resolving it needs neither the network nor transformers.
* ``local``: an existing directory holding a ``config.json`` (as written by ``save_pretrained``).
* ``hub``: anything shaped like ``org/name``; its config is read from the local Hugging Face cache,
  else fetched from the Hub.

Every bad input raises :class:`~autotune.errors.ModelNotFound` with a one-line message naming the fix.
torch and transformers are imported inside the functions that need them so the CLI starts fast.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

from autotune.errors import ModelNotFound

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "BUILTIN_MODELS",
    "ModelSpec",
    "build_model",
    "builtin_model_names",
    "count_parameters",
    "resolve_model",
]

# "trainer": the model a user's Trainer factory builds (``--trainer``, :mod:`autotune.probe.user_trainer`), its config read there.
ModelSource = Literal["builtin", "hub", "local", "trainer"]
_SOURCES: tuple[str, ...] = ("builtin", "hub", "local", "trainer")

#: Built-in model name -> short description (architecture, size). Each has a bundled config in
#: ``autotune/model_configs/<name>.json``; the real models also record their Hub id there.
BUILTIN_MODELS: dict[str, str] = {
    "polyglot-ko-1.3b": "GPT-NeoX, 1.33B params, 24 layers, hidden 2048, Korean (EleutherAI)",
    "polyglot-ko-3.8b": "GPT-NeoX, 3.81B params, 32 layers, hidden 3072, Korean (EleutherAI)",
    "polyglot-ko-5.8b": "GPT-NeoX, 5.89B params, 28 layers, hidden 4096, Korean (EleutherAI)",
    "pythia-160m": "GPT-NeoX, 162M params, 12 layers, hidden 768 (EleutherAI)",
    "pythia-410m": "GPT-NeoX, 405M params, 24 layers, hidden 1024 (EleutherAI)",
    "pythia-1b": "GPT-NeoX, 1.01B params, 16 layers, hidden 2048 (EleutherAI)",
    "gpt2": "GPT-2, 124M params, 12 layers, hidden 768 (OpenAI)",
    "llama-3.2-1b": "Llama, 1.24B params, 16 layers, hidden 2048, GQA 32/8 heads (Meta)",
    "tiny-gptneox": "GPT-NeoX, 1.4M params, 2 layers, hidden 128: for tests and demos",
    "tiny-gpt2": "GPT-2, 1.1M params, 2 layers, hidden 128: for tests and demos",
    "tiny-llama": "Llama, 1.0M params, 2 layers, hidden 128: for tests and demos",
}

# Keys of a bundled JSON file that describe the file rather than the model; stripped on load.
_HUB_ID_KEY = "_hub_id"
_META_KEYS = frozenset({_HUB_ID_KEY, "_provenance"})

# Config keys that name the same quantity in different architectures, most common first.
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_NUM_LAYERS_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model")
_NUM_HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads")
_VOCAB_SIZE_KEYS = ("vocab_size",)

# Keys that describe how a config was saved, not the model; left out when rebuilding a config.
_NON_MODEL_KEYS = ("model_type", "transformers_version", "_name_or_path", "_commit_hash")

# org/name as the Hub spells repository ids (one slash, no leading dot or slash).
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_HUB_CONNECT_TIMEOUT_S = 3.0
_EXAMPLES = "polyglot-ko-1.3b, pythia-160m, llama-3.2-1b"


@dataclass(frozen=True)
class ModelSpec:
    """A model to tune, fully described by its config; it crosses process boundaries as JSON.

    Attributes:
        name: The model as the user named it; for a built-in model its canonical built-in name
            (so ``Pythia-160M`` and ``EleutherAI/pythia-160m`` both give ``pythia-160m``).
        source: Where the config came from: ``"builtin"``, ``"hub"``, ``"local"``, or ``"trainer"`` (the
            model of a user's Trainer factory; see :mod:`autotune.probe.user_trainer`).
        config: The model's config as a JSON-serialisable dict; it includes ``model_type``.
        hub_id: The Hugging Face Hub id the config comes from, for reports; ``None`` for local
            directories and the tiny built-in test models.
    """

    name: str
    source: ModelSource
    config: dict[str, Any]
    hub_id: str | None = field(default=None)

    def __post_init__(self) -> None:
        if self.source not in _SOURCES:
            raise ValueError(f"ModelSpec.source must be one of {_SOURCES}, not {self.source!r}")
        if not isinstance(self.config, Mapping) or not isinstance(self.config.get("model_type"), str):
            raise ValueError("ModelSpec.config must be a dict with a string 'model_type'")
        # A private deep copy: the spec is frozen, so nobody may change its config behind its back.
        object.__setattr__(self, "config", copy.deepcopy(dict(self.config)))

    def __hash__(self) -> int:
        return hash(self.to_json())

    @property
    def model_type(self) -> str:
        """The transformers model type, e.g. ``"gpt_neox"``, ``"gpt2"`` or ``"llama"``."""
        return str(self.config["model_type"])

    @property
    def max_positions(self) -> int:
        """The longest sequence the model accepts (``max_position_embeddings``, or ``n_positions`` for GPT-2)."""
        return self._config_int(_MAX_POSITION_KEYS, "max_positions")

    @property
    def num_layers(self) -> int:
        """The number of transformer layers (``num_hidden_layers``, or ``n_layer`` for GPT-2)."""
        return self._config_int(_NUM_LAYERS_KEYS, "num_layers")

    @property
    def hidden_size(self) -> int:
        """The model width (``hidden_size``, or ``n_embd`` for GPT-2)."""
        return self._config_int(_HIDDEN_SIZE_KEYS, "hidden_size")

    @property
    def num_attention_heads(self) -> int:
        """The number of query heads per layer (``num_attention_heads``, or ``n_head`` for GPT-2)."""
        return self._config_int(_NUM_HEADS_KEYS, "num_attention_heads")

    @property
    def head_dim(self) -> int:
        """Q of the FLOPs formula: the config's ``head_dim`` where it sets one, else hidden size / heads."""
        return int(self.config.get("head_dim") or self.hidden_size // max(self.num_attention_heads, 1))

    @property
    def vocab_size(self) -> int:
        """The size of the token vocabulary (rows of the embedding matrix)."""
        return self._config_int(_VOCAB_SIZE_KEYS, "vocab_size")

    def _config_int(self, keys: tuple[str, ...], what: str) -> int:
        """Reads the first of ``keys`` present in the config, or in its ``text_config``.

        Args:
            keys: Config keys that name the wanted quantity, in order of preference.
            what: The property name, for the error message.

        Returns:
            The value as an int.

        Raises:
            KeyError: If no key is present (cannot happen for a spec from :func:`resolve_model`,
                which checks every property).
        """
        for scope in (self.config, self.config.get("text_config")):
            if not isinstance(scope, Mapping):
                continue
            for key in keys:
                value = scope.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        raise KeyError(f"the config of {self.name!r} has none of {', '.join(keys)} (needed for {what})")

    def to_config(self) -> PretrainedConfig:
        """Builds the transformers config object.

        Returns:
            A fresh ``PretrainedConfig`` of the model's type (legacy keys such as ``rotary_pct`` or
            ``rope_scaling`` are converted by transformers itself).
        """
        from transformers import AutoConfig

        kwargs = {key: value for key, value in copy.deepcopy(self.config).items() if key not in _NON_MODEL_KEYS}
        return AutoConfig.for_model(self.model_type, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Returns the spec as a JSON-serialisable dict (the inverse of :meth:`from_dict`)."""
        return {
            "name": self.name,
            "source": self.source,
            "config": copy.deepcopy(self.config),
            "hub_id": self.hub_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Rebuilds a spec from :meth:`to_dict` output.

        Args:
            data: A dict with ``name``, ``source``, ``config`` and optionally ``hub_id``.

        Returns:
            The spec.

        Raises:
            ValueError: If a field is missing or malformed.
        """
        missing = [key for key in ("name", "source", "config") if key not in data]
        if missing:
            raise ValueError(f"not a ModelSpec dict: missing {', '.join(missing)}")
        hub_id = data.get("hub_id")
        if not isinstance(data["name"], str) or (hub_id is not None and not isinstance(hub_id, str)):
            raise ValueError("not a ModelSpec dict: name and hub_id must be strings")
        return cls(name=data["name"], source=data["source"], config=dict(data["config"]), hub_id=hub_id)

    def to_json(self) -> str:
        """Returns the spec as a JSON string (the inverse of :meth:`from_json`)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """Rebuilds a spec from :meth:`to_json` output.

        Args:
            text: The JSON string.

        Returns:
            The spec.

        Raises:
            ValueError: If the text is not valid JSON or not a spec.
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a ModelSpec JSON object")
        return cls.from_dict(data)


def builtin_model_names() -> list[str]:
    """Returns the names of the built-in models, in the order of :data:`BUILTIN_MODELS`."""
    return list(BUILTIN_MODELS)


def resolve_model(name_or_path: str) -> ModelSpec:
    """Turns what the user typed into a :class:`ModelSpec`.

    Tried in order: a built-in name (case-insensitive; offline); an existing local directory with a
    ``config.json``; the Hub id of a built-in model (offline, bundled config); a Hub id ``org/name``
    (local Hugging Face cache first, then the Hub). A name that contains a path separator or starts
    with ``.`` or ``~`` is never taken for a built-in name, so ``./gpt2`` means a directory.

    Args:
        name_or_path: A built-in name, a local directory, or a Hugging Face Hub id.

    Returns:
        The resolved spec; its config has every property :class:`ModelSpec` exposes.

    Raises:
        ModelNotFound: For an unknown name (listing close built-in matches), a missing directory, a
            directory without ``config.json``, an unreadable or unsupported config, a model that is not
            a causal language model, or a Hub id that cannot be fetched (e.g. the Hub is unreachable).
    """
    text = name_or_path.strip() if isinstance(name_or_path, str) else ""
    if not text:
        raise ModelNotFound(
            f"no model given; pass a built-in name (e.g. {_EXAMPLES}), a local directory with config.json, "
            "or a Hugging Face Hub id (org/name)"
        )
    pathlike = text.startswith((".", "~")) or "/" in text or "\\" in text or os.sep in text

    if not pathlike and text.lower() in BUILTIN_MODELS:
        return _builtin_spec(text.lower())

    path = Path(text).expanduser()
    if path.exists():
        return _local_spec(text, path)

    builtin = _builtin_by_hub_id().get(text.lower())
    if builtin is not None:
        return _builtin_spec(builtin)

    if _HUB_ID_RE.match(text):
        return _hub_spec(text)

    if pathlike:
        raise ModelNotFound(
            f"no such directory: '{text}'; pass an existing directory that contains config.json, "
            f"a built-in name (e.g. {_EXAMPLES}) or a Hugging Face Hub id (org/name)"
        )
    raise ModelNotFound(_unknown_name_message(text))


def build_model(
    spec: ModelSpec,
    *,
    attn_implementation: str | None,
    device: str,
    dtype: torch.dtype | str | None = None,
) -> torch.nn.Module:
    """Builds the causal-LM with random weights, directly on ``device``, ready to train.

    Args:
        spec: The model.
        attn_implementation: The attention kernel, e.g. ``"eager"``, ``"sdpa"`` or
            ``"flash_attention_2"``; ``None`` lets transformers choose.
        device: Where to allocate the weights, e.g. ``"cuda"``, ``"cuda:0"`` or ``"cpu"``; the model is
            created there (``with torch.device(device)``), never on the CPU first.
        dtype: The parameter dtype (a ``torch.dtype`` or its name such as ``"bfloat16"``). ``None``
            means float32, the master-weight dtype that mixed-precision training expects; the
            ``torch_dtype`` saved in a published config is deliberately ignored.

    Returns:
        The model (``AutoModelForCausalLM.from_config``), with ``config.use_cache`` off for training.

    Raises:
        ValueError: If transformers rejects ``attn_implementation`` for this model or device
            (e.g. flash-attention is not installed).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = spec.to_config()
    config.use_cache = False
    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=_torch_dtype(dtype)
        )


def count_parameters(spec: ModelSpec) -> int:
    """Counts the model's parameters without allocating them.

    The model is built on the meta device; parameters shared between modules (tied input and output
    embeddings) are counted once, as ``model.parameters()`` yields each parameter once.

    Args:
        spec: The model.

    Returns:
        The number of unique parameters.
    """
    return _count_parameters_cached(spec.to_json())


@lru_cache(maxsize=64)
def _count_parameters_cached(spec_json: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    spec = ModelSpec.from_json(spec_json)
    config = spec.to_config()
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return sum(parameter.numel() for parameter in model.parameters())


# --- helpers -------------------------------------------------------------------------------------


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """Maps ``None`` to float32 and a dtype name such as ``"bfloat16"`` to the torch dtype."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'")
    return resolved


def _read_bundled(name: str) -> dict[str, Any]:
    """Reads ``model_configs/<name>.json`` from the package, meta keys included."""
    path = resources.files("autotune").joinpath("model_configs").joinpath(f"{name}.json")
    return json.loads(path.read_text(encoding="utf-8"))


@cache
def _builtin_by_hub_id() -> dict[str, str]:
    """Maps the lower-cased Hub id of each real built-in model to its built-in name."""
    mapping: dict[str, str] = {}
    for name in BUILTIN_MODELS:
        hub_id = _read_bundled(name).get(_HUB_ID_KEY)
        if hub_id:
            mapping[hub_id.lower()] = name
    return mapping


def _builtin_spec(name: str) -> ModelSpec:
    """Loads the bundled config of a built-in model (no network, no transformers)."""
    raw = _read_bundled(name)
    config = {key: value for key, value in raw.items() if key not in _META_KEYS}
    return ModelSpec(name=name, source="builtin", config=config, hub_id=raw.get(_HUB_ID_KEY))


def _local_spec(text: str, path: Path) -> ModelSpec:
    """Reads the config of a local model directory."""
    if not path.is_dir():
        raise ModelNotFound(f"'{text}' is a file; pass the directory that contains config.json instead")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(
            f"directory '{text}' has no config.json; pass a model directory (as written by save_pretrained) "
            f"or a built-in name (e.g. {_EXAMPLES})"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, json.JSONDecodeError) as error:  # unreadable or not JSON
        raise ModelNotFound(
            f"cannot read {config_file}: {_first_line(error)}; fix the file or pass another model"
        ) from error
    except ValueError as error:  # unknown or missing model_type, custom code
        raise ModelNotFound(_unsupported_message(text, error)) from error
    return _checked_spec(text, "local", config, hub_id=None)


def _hub_spec(repo_id: str) -> ModelSpec:
    """Reads a Hub model's config from the local Hugging Face cache, else fetches it from the Hub."""
    from transformers import AutoConfig

    try:  # The cache first: no network, and works offline.
        config = AutoConfig.from_pretrained(repo_id, local_files_only=True, trust_remote_code=False)
    except ValueError as error:
        raise ModelNotFound(_unsupported_message(repo_id, error)) from error
    except OSError:
        config = None  # Not cached.
    if config is not None:
        return _checked_spec(repo_id, "hub", config, repo_id)

    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        raise ModelNotFound(_unreachable_message(repo_id, " (offline mode: HF_HUB_OFFLINE is set)"))
    if not _hub_reachable():
        raise ModelNotFound(_unreachable_message(repo_id))
    try:
        config = AutoConfig.from_pretrained(repo_id, trust_remote_code=False)
    except ValueError as error:
        raise ModelNotFound(_unsupported_message(repo_id, error)) from error
    except OSError as error:
        kind = _hub_error_kind(error)
        if kind == "unreachable":
            raise ModelNotFound(_unreachable_message(repo_id)) from error
        if kind == "gated":
            raise ModelNotFound(
                f"'{repo_id}' is a gated model on the Hugging Face Hub; accept its license on its Hub page "
                f"and log in (hf auth login), or use a built-in model (e.g. {_EXAMPLES})"
            ) from error
        if kind == "not_found":
            raise ModelNotFound(
                f"'{repo_id}' is neither a local directory nor a model on the Hugging Face Hub; check the "
                f"spelling, or use a built-in model (e.g. {_EXAMPLES})"
            ) from error
        raise ModelNotFound(
            f"cannot fetch the config of '{repo_id}' from the Hugging Face Hub: {_first_line(error)}; "
            f"use a built-in model (e.g. {_EXAMPLES}) or a local directory with config.json"
        ) from error
    return _checked_spec(repo_id, "hub", config, repo_id)


def _checked_spec(text: str, source: ModelSource, config: PretrainedConfig, hub_id: str | None) -> ModelSpec:
    """Makes a spec of a transformers config, checking autotune can build and describe the model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelNotFound(
            f"'{text}' is a '{model_type}' model, which has no causal-LM class in transformers; "
            f"autotune tunes causal language models, e.g. {_EXAMPLES}"
        )
    spec = ModelSpec(name=text, source=source, config=json.loads(config.to_json_string(use_diff=False)), hub_id=hub_id)
    try:
        for prop in ("max_positions", "num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            getattr(spec, prop)
    except KeyError as error:
        raise ModelNotFound(f"{error.args[0]}; autotune cannot size this model, pick another one") from error
    return spec


def _unreachable_message(repo_id: str, why: str = "") -> str:
    """The one-line message for a Hub model whose config is neither cached nor fetchable."""
    return (
        f"cannot fetch the config of '{repo_id}': the Hugging Face Hub is unreachable{why} and the config is "
        f"not in the local cache; use a built-in model (e.g. {_EXAMPLES}) or a local directory with config.json"
    )


def _unsupported_message(text: str, error: Exception) -> str:
    """The one-line message for a config transformers cannot load (custom code, unknown type)."""
    detail = str(error)
    if "trust_remote_code" in detail:
        return (
            f"'{text}' needs custom code from its repository (trust_remote_code), which autotune does not run; "
            "use a model whose architecture is built into transformers"
        )
    return (
        f"transformers cannot load the config of '{text}': {_first_line(error)}; "
        "upgrade transformers or use a model it supports"
    )


def _unknown_name_message(text: str) -> str:
    """The one-line message for an unknown plain name, with close built-in matches if any."""
    names = builtin_model_names()
    close = difflib.get_close_matches(text.lower(), names, n=3, cutoff=0.6)
    other = "for other models pass a local directory with config.json or a Hugging Face Hub id (org/name)"
    if close:
        also = f" (also close: {', '.join(close[1:])})" if len(close) > 1 else ""
        return f"unknown model '{text}'; did you mean {close[0]}?{also} {other[0].upper()}{other[1:]}"
    return f"unknown model '{text}'; use a built-in model ({', '.join(names)}), or {other}"


def _hub_error_kind(error: BaseException) -> str:
    """Classifies a failed Hub fetch as ``unreachable``, ``gated``, ``not_found`` or ``other``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if name == "GatedRepoError":
            return "gated"
        if name in ("RepositoryNotFoundError", "RevisionNotFoundError"):
            return "not_found"
        if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout", "ConnectError"):
            return "unreachable"
        current = current.__cause__ or current.__context__
    message = str(error).lower()
    if "gated" in message:
        return "gated"
    if "not a valid model identifier" in message or "not a local folder" in message:
        return "not_found"
    if "couldn't connect" in message or "offline" in message:
        return "unreachable"
    return "other"


def _hub_reachable() -> bool:
    """Quickly checks that the Hub endpoint accepts TCP connections (seconds, not a minute of retries).

    Behind a proxy the direct check means nothing, so it answers True and lets the fetch decide.
    """
    if any(os.environ.get(var) for var in _PROXY_VARS):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=_HUB_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def _env_true(var: str) -> bool:
    """Whether an environment variable is set to a true value (1, true, yes, on)."""
    return os.environ.get(var, "").strip().upper() in {"1", "TRUE", "YES", "ON"}


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an error message, shortened to keep messages on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0].rstrip(".") if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
