"""Random-weight model sizes past ``tiny``, for measuring how cost grows with the model.

``tiny`` is the builders' own size (a 2-layer text model of 4 heads x head_dim). ``small``
and ``medium`` are the sizes the vLLM peer comparison uses (``scripts/peer_vllm.sh``):
random weights, the tiny tokenizer and processor, real Qwen2.5-VL configuration classes, so
vLLM and transformers load them as they load the released checkpoints.

| size | text (layers x width, heads/KV heads of 64) | vision (layers x width) | parameters |
|---|---|---|---|
| small | 8 x 512, 8/2, MLP 1536 | 2 x 640, 10 heads, MLP 1710 | ~43 M |
| medium | 16 x 768, 12/4, MLP 2304 | 4 x 768, 12 heads, MLP 2048 | ~150 M |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError


@dataclass(frozen=True)
class ModelSize:
    """Overrides of the tiny builder's text and vision configuration."""

    head_dim: int
    text: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)


SIZES: dict[str, ModelSize | None] = {
    "tiny": None,
    "small": ModelSize(64, dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=2),
                       dict(depth=2, hidden_size=640, intermediate_size=1710, num_heads=10,
                            fullatt_block_indexes=[1])),
    "medium": ModelSize(64, dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=16,
                                 num_attention_heads=12, num_key_value_heads=4),
                        dict(depth=4, hidden_size=768, intermediate_size=2048, num_heads=12,
                             fullatt_block_indexes=[1, 3])),
}
#: the families built at every size (the peer comparison's)
SIZED_FAMILIES = ("qwen2_5_vl",)


def get_size(name: str, arch: str, head_dim: int | None) -> ModelSize | None:
    """The size called ``name`` for family ``arch``, refusing what cannot be built."""
    if name not in SIZES:
        raise ConfigError(f"--size {name!r} is not a model size",
                          hint=f"use one of {', '.join(SIZES)}", code="invalid_flag")
    size = SIZES[name]
    if size is not None and arch not in SIZED_FAMILIES:
        raise ConfigError(f"--size {name} is built for {', '.join(SIZED_FAMILIES)} only, not "
                          f"{arch}", hint="use --size tiny for other families",
                          code="invalid_flag")
    if size is not None and head_dim is not None and head_dim != size.head_dim:
        raise ConfigError(f"--size {name} has head_dim {size.head_dim}; --head-dim "
                          f"{head_dim} applies to --size tiny only",
                          hint="leave out --head-dim", code="invalid_flag")
    return size
