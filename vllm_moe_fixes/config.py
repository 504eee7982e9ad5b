"""MoE model shapes for the planner and the demo: public presets and JSON files of the same fields.

Only what the MoE layers and the dummy run depend on is kept: the hidden size K, the experts'
intermediate size I, the routed experts E and top-k, the vocabulary (dummy token ids), the layer
count (expert weights per rank) and the router (softmax top-k, or DeepSeek's grouped top-k on
sigmoid scores). Shared experts and the dense layers' weights are not modelled.

Presets (values from each model's public ``config.json``):

| preset | hidden | moe inter. | experts | top-k | vocab | layers (dense) | router |
|---|---|---|---|---|---|---|---|
| deepseek-v3, deepseek-r1 | 7168 | 2048 | 256 | 8 | 129280 | 61 (3) | sigmoid, 8 groups, top-4 groups, x2.5 |
| qwen3-30b-a3b | 2048 | 768 | 128 | 8 | 151936 | 48 (0) | softmax |
| qwen3-235b-a22b | 4096 | 1536 | 128 | 8 | 151936 | 94 (0) | softmax |
| mixtral-8x7b | 4096 | 14336 | 8 | 2 | 32000 | 32 (0) | softmax |
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

SCORINGS = ("softmax", "sigmoid")
# Largest value of each integer field, twice or more the largest public MoE model's (hidden 7168-
# 8192, 512 experts, vocabularies of about 256k, 94 layers). The planner's simulated router holds
# a float32 gate [E, H] and multiplies it by its transpose, so these bound its memory and time (at
# the limits: 64 MiB, about 5 s); a larger value is a named error instead of numpy's MemoryError.
MAX_FIELD_VALUES = {"hidden_size": 16384, "moe_intermediate_size": 65536, "num_experts": 1024,
                    "top_k": 1024, "vocab_size": 2**24, "num_layers": 1024, "n_group": 1024,
                    "topk_group": 1024}


@dataclass(frozen=True)
class MoEModelConfig:
    """Shapes of a model's MoE layers.

    Fields: ``name``; ``hidden_size`` K; ``moe_intermediate_size`` I (w1 is [E, 2I, K], w2 is
    [E, K, I]); ``num_experts`` E (routed); ``top_k``; ``vocab_size``; ``num_layers`` (all decoder
    layers); ``num_dense_layers`` (leading layers without experts, default 0); ``scoring``
    ("softmax" or "sigmoid"); ``n_group`` / ``topk_group`` (grouped routing: experts split into
    n_group equal groups, only the topk_group best groups are eligible; 1 / 1 = plain top-k);
    ``routed_scaling_factor`` (multiplies the routing weights, DeepSeek-V3's 2.5; default 1.0).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    vocab_size: int
    num_layers: int
    scoring: str = "softmax"
    num_dense_layers: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field, limit in MAX_FIELD_VALUES.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise ValueError(f"{self.name}: {field} must be an int in [1, {limit}], got "
                                 f"{value!r}")
        dense = self.num_dense_layers
        if (isinstance(dense, bool) or not isinstance(dense, int)
                or not 0 <= dense < self.num_layers):
            raise ValueError(f"{self.name}: num_dense_layers must be an int in [0, num_layers="
                             f"{self.num_layers}), got {dense!r}")
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not 0 < factor < float("inf"):
            raise ValueError(f"{self.name}: routed_scaling_factor must be a finite number > 0, "
                             f"got {factor!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"{self.name}: scoring must be one of {', '.join(SCORINGS)}, "
                             f"got {self.scoring!r}")
        if self.num_experts % self.n_group:
            raise ValueError(f"{self.name}: num_experts={self.num_experts} is not divisible by "
                             f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"{self.name}: topk_group={self.topk_group} > n_group={self.n_group}")
        eligible = self.topk_group * self.num_experts // self.n_group
        if self.top_k > eligible:
            raise ValueError(f"{self.name}: top_k={self.top_k} exceeds the {eligible} experts "
                             f"of the topk_group={self.topk_group} eligible groups")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"{self.name}: grouped routing scores a group by its best 2 experts; "
                             f"groups of {self.num_experts // self.n_group} expert are too small")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _deepseek(name: str) -> MoEModelConfig:
    return MoEModelConfig(name, hidden_size=7168, moe_intermediate_size=2048, num_experts=256,
                          top_k=8, vocab_size=129280, num_layers=61, num_dense_layers=3,
                          scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)


PRESETS: dict[str, MoEModelConfig] = {
    cfg.name: cfg for cfg in (
        _deepseek("deepseek-v3"),
        _deepseek("deepseek-r1"),
        MoEModelConfig("qwen3-30b-a3b", hidden_size=2048, moe_intermediate_size=768,
                       num_experts=128, top_k=8, vocab_size=151936, num_layers=48),
        MoEModelConfig("qwen3-235b-a22b", hidden_size=4096, moe_intermediate_size=1536,
                       num_experts=128, top_k=8, vocab_size=151936, num_layers=94),
        MoEModelConfig("mixtral-8x7b", hidden_size=4096, moe_intermediate_size=14336,
                       num_experts=8, top_k=2, vocab_size=32000, num_layers=32),
    )
}


def config_from_dict(data: dict, default_name: str = "custom") -> MoEModelConfig:
    """Build a config from a dict of ``MoEModelConfig`` fields; unknown or missing fields raise
    ``ValueError`` naming them (``name`` defaults to ``default_name``)."""
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 -- a bad config file, reported like every other
            f"a model config must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(MoEModelConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown model config field(s): {', '.join(unknown)}; "
                         f"allowed: {', '.join(fields)}")
    data = {"name": default_name, **data}
    missing = [name for name, f in fields.items()
               if name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"model config is missing field(s): {', '.join(missing)}")
    return MoEModelConfig(**data)


class _LongIntegerLiteral:
    """A JSON integer of more digits than ``int()`` converts (``sys.get_int_max_str_digits()``),
    kept as text: the field check then refuses it by field name, where ``int()`` would raise an
    error naming neither the file nor the field."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"an integer of {len(self.text.lstrip('-'))} digits"


def _json_int(text: str) -> int | _LongIntegerLiteral:
    try:
        return int(text)
    except ValueError:  # only the digit limit: json hands over valid integer literals
        return _LongIntegerLiteral(text)


def load_model_config(model: str) -> MoEModelConfig:
    """Return the preset named ``model`` or, when ``model`` is a path to a ``.json`` file (or any
    existing file), the config it holds. Raises ``ValueError`` for an unknown preset, an unreadable
    file, bad JSON (also nested deeper than Python's parser goes) or a bad field, naming the file
    and the field."""
    if model in PRESETS:
        return PRESETS[model]
    if model.endswith(".json") or os.path.isfile(model):
        try:
            with open(model, encoding="utf-8") as f:
                data = json.load(f, parse_int=_json_int)
        except UnicodeDecodeError as e:  # a ValueError too, but one that names no file
            raise ValueError(f"cannot read model config {model!r}: it is not UTF-8 text "
                             f"({e})") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {model!r}: {e}") from None
        except RecursionError:
            raise ValueError(f"cannot read model config {model!r}: its JSON is nested deeper "
                             "than Python's parser goes (a model config is one flat object)"
                             ) from None
        stem = os.path.splitext(os.path.basename(model))[0]
        try:
            return config_from_dict(data, default_name=stem)
        except ValueError as e:
            raise ValueError(f"model config {model!r}: {e}") from None
    raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}; "
                     f"or a path to a JSON file of the same fields")
