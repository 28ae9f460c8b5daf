"""Tiny random-weight instances of the registered families: real config classes at tiny
sizes, a locally trained tokenizer with the family's special tokens, the real processor
classes, saved with ``save_pretrained``. Deterministic for a seed; seconds to build.

``head_dim``: the text model's attention head size. The builders default to 16
(:data:`TEST_HEAD_DIM`), the size of the cached ``tiny:ARCH`` models the tests use; the text
width follows it (hidden = 4 heads x head_dim, MLP 2 x hidden, the vision/audio projection out
to that width) and Qwen's M-RoPE sections are scaled to sum to head_dim / 2. vLLM's CPU
attention refuses head_dim 16, so ``aphrodite model make-tiny`` builds 32 by default
(``--head-dim``)."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError
from engine.models.sizes import ModelSize, get_size
from engine.models.templates_path import template_text

#: head_dim of the builders' default, so of every cached ``tiny:ARCH`` model (changing it
#: changes those models: bump ``engine.models.loader.TINY_VERSION`` with it).
TEST_HEAD_DIM = 16
_HEADS = 4


def _text(head_dim: int) -> dict:
    """The tiny text model's sizes for ``head_dim`` (at 16: hidden 64, MLP 128)."""
    if head_dim < 8 or head_dim % 2:
        raise ConfigError(f"head_dim {head_dim} is not an even number of at least 8",
                          hint="e.g. --head-dim 32", code="invalid_flag")
    hidden = _HEADS * head_dim
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=_HEADS, num_key_value_heads=2,
                max_position_embeddings=4096)


def _mrope_section(base: list[int], head_dim: int) -> list[int]:
    """``base`` (the T/H/W split at head_dim 16) scaled to sum to ``head_dim / 2`` (largest
    remainders get the rounding), each part at least 1."""
    half, total = head_dim // 2, sum(base)
    exact = [b * half / total for b in base]
    parts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(base)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order[:half - sum(parts)]:
        parts[i] += 1
    return parts


def _seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _save(model, processor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)


def _qwen_vl_tokenizer():
    from engine.models.tokenizer import qwen2_tokenizer

    return qwen2_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
                           eos="<|im_end|>", pad="<|endoftext|>")


def _qwen_vl_processor(cls_name: str, tok):
    import transformers as T

    image = T.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 256)
    video = T.Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 128,
                                    cap_pixels_per_frame=True)
    return getattr(T, cls_name)(image_processor=image, tokenizer=tok, video_processor=video,
                                chat_template=template_text("qwen2_vl"))


def _qwen_token_ids(tok) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"),
                vision_end_token_id=ids("<|vision_end|>"),
                eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
                bos_token_id=ids("<|endoftext|>"))


def _qwen_text_config(tok, ids: dict[str, int], head_dim: int) -> dict:
    return dict(_text(head_dim), vocab_size=len(tok), tie_word_embeddings=True,
                rope_scaling={"type": "mrope",
                              "mrope_section": _mrope_section([2, 3, 3], head_dim)},
                eos_token_id=ids["eos_token_id"], bos_token_id=ids["bos_token_id"],
                pad_token_id=ids["pad_token_id"])


def build_qwen2_5_vl(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM,
                     size: ModelSize | None = None) -> None:
    """Tiny, or at a larger ``size`` (see :mod:`engine.models.sizes`)."""
    import transformers as T

    tok = _qwen_vl_tokenizer()
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids, size.head_dim if size else head_dim)
    text.update(size.text if size else {})
    hidden = text["hidden_size"]
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    vision.update(size.vision if size else {})
    config = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    _seed(seed)
    _save(T.Qwen2_5_VLForConditionalGeneration(config).eval(),
          _qwen_vl_processor("Qwen2_5_VLProcessor", tok), out)


def build_qwen2_vl(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    import transformers as T

    tok = _qwen_vl_tokenizer()
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids, head_dim)
    hidden = text["hidden_size"]
    vision = dict(depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = T.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    _seed(seed)
    _save(T.Qwen2VLForConditionalGeneration(config).eval(),
          _qwen_vl_processor("Qwen2VLProcessor", tok), out)


def build_qwen3_vl(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """Qwen3-VL at tiny size: 16-pixel patches (32 per merged token), deepstack features from
    both vision layers, interleaved M-RoPE (T/H/W sections in the real 24:20:20 spirit), tied
    embeddings like the 2B/4B checkpoints; its video prompts carry per-patch timestamps."""
    import transformers as T

    tok = _qwen_vl_tokenizer()
    ids = _qwen_token_ids(tok)
    text = dict(_text(head_dim), head_dim=head_dim, vocab_size=len(tok),
                eos_token_id=ids["eos_token_id"], bos_token_id=ids["bos_token_id"],
                pad_token_id=ids["pad_token_id"],
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": _mrope_section([4, 2, 2], head_dim),
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    tokens = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id")}
    config = T.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                             **tokens)
    half = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, patch_size=16)
    image = T.Qwen2VLImageProcessor(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256, **half)
    # The engine samples frames itself (engine/media/video/sampling.py) and passes their
    # indices and the clip's fps as video_metadata, so the processor must not resample.
    video = T.Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32 * 4,
                                          "longest_edge": 32 * 32 * 128},
                                    cap_pixels_per_frame=True, do_sample_frames=False, **half)
    processor = T.Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                   chat_template=template_text("qwen3_vl"))
    _seed(seed)
    _save(T.Qwen3VLForConditionalGeneration(config).eval(), processor, out)


def build_llava(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """LLaVA-1.5 at tiny size. Like llava-hf/llava-1.5-7b-hf, no chat template is saved."""
    import transformers as T

    from engine.models.tokenizer import generic_tokenizer

    tok = generic_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>"], bos="<s>", eos="</s>",
                            pad="<pad>", unk="<unk>")
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=56, patch_size=14,
                                projection_dim=32)
    text = T.LlamaConfig(**_text(head_dim), vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                           image_seq_length=16, vision_feature_select_strategy="default",
                           vision_feature_layer=-2)
    processor = T.LlavaProcessor(
        image_processor=T.CLIPImageProcessor(size={"shortest_edge": 56},
                                             crop_size={"height": 56, "width": 56}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    _seed(seed)
    _save(T.LlavaForConditionalGeneration(config).eval(), processor, out)


def build_qwen2_audio(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    import transformers as T

    from engine.models.tokenizer import qwen2_tokenizer

    tok = qwen2_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>",
                           "<|AUDIO|>", "<|audio_eos|>"], eos="<|im_end|>", pad="<|endoftext|>")
    ids = tok.convert_tokens_to_ids
    text = T.Qwen2Config(**_text(head_dim), vocab_size=len(tok), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"))
    audio = T.Qwen2AudioEncoderConfig(num_mel_bins=128, encoder_layers=2, d_model=32,
                                      encoder_attention_heads=2, encoder_ffn_dim=64,
                                      max_source_positions=1500)
    config = T.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                audio_token_index=ids("<|AUDIO|>"))
    processor = T.Qwen2AudioProcessor(
        feature_extractor=T.WhisperFeatureExtractor(feature_size=128, return_attention_mask=True),
        tokenizer=tok, chat_template=template_text("qwen2_audio"))
    _seed(seed)
    _save(T.Qwen2AudioForConditionalGeneration(config).eval(), processor, out)


def build_tiny(arch: str, out: Path, seed: int = 0, head_dim: int | None = None,
               size: str = "tiny") -> None:
    """The model of family ``arch``: tiny with text head size ``head_dim`` (default
    :data:`TEST_HEAD_DIM`, what the registry's ``build_tiny`` builds), or a larger ``size``
    (:data:`engine.models.sizes.SIZES`)."""
    import importlib

    from engine.models.registry import get_arch

    sized = get_size(size, get_arch(arch).name, head_dim)
    head_dim = TEST_HEAD_DIM if head_dim is None else head_dim
    _text(head_dim)  # refuse a bad size before building anything
    module, func = get_arch(arch).builder.rsplit(":", 1)
    extra = {"size": sized} if sized is not None else {}
    getattr(importlib.import_module(module), func)(Path(out), seed, head_dim=head_dim, **extra)
