"""Tiny builders of LLaVA-OneVision, InternVL3 and Gemma 3: the real config, processor and
tokenizer classes at tiny sizes, as in :mod:`engine.models.tiny` (whose sizing rules they share:
``head_dim`` 16 by default, hidden = 4 heads x head_dim)."""

from __future__ import annotations

from pathlib import Path

from engine.models.templates_path import template_text
from engine.models.tiny import TEST_HEAD_DIM, _save, _seed, _text


def build_llava_onevision(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """LLaVA-OneVision at tiny size: a SigLIP tower on 56-pixel tiles of 14-pixel patches (16
    tokens a tile; the real model: 384 and 729), anyres tiling on the real 1x1..6x6 grid of
    tiles (``anyres_max_9``), video frames pooled 2x2 to 4 tokens, a Qwen2 text model; the
    chat template its processor ships."""
    import transformers as T

    from engine.models.tokenizer import qwen2_tokenizer

    tok = qwen2_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"],
                          eos="<|im_end|>", pad="<|endoftext|>")
    ids = tok.convert_tokens_to_ids
    tile = 56
    pinpoints = [[tile * i, tile * j] for i in range(1, 7) for j in range(1, 7)]
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=tile, patch_size=14,
                                  vision_use_head=False)
    text = T.Qwen2Config(**_text(head_dim), vocab_size=len(tok), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"))
    config = T.LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=ids("<image>"),
        video_token_index=ids("<video>"), vision_feature_select_strategy="full",
        vision_feature_layer=-1, image_grid_pinpoints=pinpoints,
        vision_aspect_ratio="anyres_max_9")
    size = {"height": tile, "width": tile}
    processor = T.LlavaOnevisionProcessor(
        image_processor=T.LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints),
        video_processor=T.LlavaOnevisionVideoProcessor(size=size), tokenizer=tok,
        num_image_tokens=(tile // 14) ** 2, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9", chat_template=template_text("llava_onevision"))
    _seed(seed)
    _save(T.LlavaOnevisionForConditionalGeneration(config).eval(), processor, out)


def build_internvl(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """InternVL3 at tiny size: an InternViT-style tower on 56-pixel tiles of 7-pixel patches,
    pixel-shuffled 2x2 to 16 tokens a tile (the real model: 448, 14 and 256), an image cut into
    up to 12 tiles plus a thumbnail, a video as one tile per frame, a Qwen2 text model; a Qwen2
    tokenizer with InternVL's named tokens, and the chat template its processor ships."""
    import json

    import transformers as T

    from engine.models.tokenizer import train_byte_level_bpe

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>",
                "<IMG_CONTEXT>", "<video>"]
    trained = json.loads(train_byte_level_bpe(specials).to_str())["model"]
    # InternVL's processor reads its tokens from the tokenizer's named extra special tokens.
    tok = T.Qwen2Tokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]],
                           unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                           extra_special_tokens={"start_image_token": "<img>",
                                                 "end_image_token": "</img>",
                                                 "context_image_token": "<IMG_CONTEXT>",
                                                 "video_token": "<video>"})
    tok.add_tokens(specials, special_tokens=True)
    ids = tok.convert_tokens_to_ids
    tile, patch = 56, 7
    per_tile = (tile // patch) ** 2 // 4  # 0.5 downsampling on each side
    vision = T.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, image_size=tile, patch_size=patch)
    text = T.Qwen2Config(**_text(head_dim), vocab_size=len(tok), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"))
    config = T.InternVLConfig(vision_config=vision, text_config=text,
                              image_token_id=ids("<IMG_CONTEXT>"), image_seq_length=per_tile,
                              downsample_ratio=0.5, vision_feature_layer=-1,
                              vision_feature_select_strategy="default")
    imagenet = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    size = {"height": tile, "width": tile}
    processor = T.InternVLProcessor(
        image_processor=T.GotOcr2ImageProcessor(size=size, max_patches=12, **imagenet),
        video_processor=T.InternVLVideoProcessor(size=size, **imagenet), tokenizer=tok,
        image_seq_length=per_tile, chat_template=template_text("internvl"))
    _seed(seed)
    _save(T.InternVLForConditionalGeneration(config).eval(), processor, out)


_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                   "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Newline runs and text next to them, so the vocabulary merges "\n\n" and "\n\n\n" as Gemma's
# does: then assembling a prompt from separately tokenized pieces would show (its processor
# writes a blank line on either side of each image).
_GEMMA_CORPUS = [
    "user\nDescribe this image in detail.\n\nWhat is happening in this video?\n\n\nThe end.",
    "model\nThe quick brown fox jumps over the lazy dog.\n\nA cat sits on a red mat.\n",
    "Here is the original image and here are some crops to help you see better\n\n\n",
    "You are a helpful assistant. 0 1 2 3 4 5 6 7 8 9 10 yes no maybe, and; or: the a an of",
]


def _gemma_tokenizer():
    """The real ``GemmaTokenizer`` (byte-fallback BPE over text whose spaces are "▁", no
    pre-tokenizer) over a locally trained vocabulary, with Gemma 3's named image tokens."""
    import json
    import string

    import transformers as T
    from tokenizers import Tokenizer, models, normalizers, trainers

    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=_GEMMA_SPECIALS + byte_tokens,
                                  initial_alphabet=[*string.printable, "▁"], show_progress=False)
    trainer_tok.train_from_iterator(_GEMMA_CORPUS * 20, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    tok = T.GemmaTokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]],
                           add_bos_token=True,
                           extra_special_tokens={"boi_token": "<start_of_image>",
                                                 "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})
    tok.add_tokens(_GEMMA_SPECIALS[5:], special_tokens=True)
    return tok


def build_gemma3(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """Gemma 3 at tiny size: a sliding-window layer (window 16, shorter than the test prompts:
    the real models: 512 or 1024) then a global one (the real 5:1 pattern, cut to two layers),
    a SigLIP tower on 56-pixel images of 7-pixel patches pooled to 16 tokens (the real model:
    896, 14 and 256), pan-and-scan crops when asked; the chat template its processor ships."""
    import transformers as T

    tok = _gemma_tokenizer()
    ids = tok.convert_tokens_to_ids
    tile, patch, tokens = 56, 7, 16
    text = T.Gemma3TextConfig(**_text(head_dim), head_dim=head_dim, vocab_size=len(tok),
                              query_pre_attn_scalar=head_dim, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"],
                              pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"),
                              eos_token_id=[ids("<eos>"), ids("<end_of_turn>")])
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=tile, patch_size=patch,
                                  vision_use_head=False)
    config = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                            boi_token_index=ids("<start_of_image>"),
                            eoi_token_index=ids("<end_of_image>"),
                            image_token_index=ids("<image_soft_token>"))
    processor = T.Gemma3Processor(
        image_processor=T.Gemma3ImageProcessor(size={"height": tile, "width": tile},
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tok, image_seq_length=tokens, chat_template=template_text("gemma3"))
    _seed(seed)
    _save(T.Gemma3ForConditionalGeneration(config).eval(), processor, out)


def build_smolvlm(out: Path, seed: int = 0, head_dim: int = TEST_HEAD_DIM) -> None:
    """SmolVLM2 at tiny size: an image split into up to 4x4 tiles of 56 pixels plus a global
    view (the real models: 384 or 512-pixel tiles, up to 4x4 or 5x5), each a SigLIP-style tower
    on 7-pixel patches pixel-shuffled 2x2 to 16 tokens (the real: 81 or 64); a video as
    timestamped frames of one tile each; a Llama text model (SmolLM2); the chat template of
    its processor (the video-capable one)."""
    import transformers as T
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from engine.models.tokenizer import generic_tokenizer

    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok = generic_tokenizer(["<|endoftext|>", "<|im_start|>", "<end_of_utterance>",
                             "<fake_token_around_image>", "<global-img>", "<image>", "<video>",
                             *grid], bos="<|im_start|>", eos="<end_of_utterance>",
                            pad="<|endoftext|>", unk="<|endoftext|>")
    ids = tok.convert_tokens_to_ids
    tile, patch, scale = 56, 7, 2
    tokens = (tile // patch) ** 2 // scale ** 2
    vision = T.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, image_size=tile, patch_size=patch)
    text = T.LlamaConfig(**_text(head_dim), vocab_size=len(tok), bos_token_id=ids("<|im_start|>"),
                         eos_token_id=ids("<end_of_utterance>"),
                         pad_token_id=ids("<|endoftext|>"))
    config = T.SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=scale,
                             image_token_id=ids("<image>"), pad_token_id=ids("<|endoftext|>"))
    longest = {"longest_edge": 4 * tile}
    processor = T.SmolVLMProcessor(
        image_processor=T.SmolVLMImageProcessor(size=longest,
                                                max_image_size={"longest_edge": tile}),
        video_processor=T.SmolVLMVideoProcessor(
            size=longest, max_image_size={"longest_edge": tile},
            video_sampling={"fps": 1, "max_frames": 16, "video_size": {"longest_edge": tile}}),
        tokenizer=tok, image_seq_len=tokens, chat_template=DEFAULT_CHAT_TEMPLATE)
    _seed(seed)
    _save(T.SmolVLMForConditionalGeneration(config).eval(), processor, out)
