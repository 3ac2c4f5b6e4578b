"""The architecture of the tiny Qwen2.5-Omni checkpoint: the published model's, shrunk.

Every sub-model keeps its real class and wiring (thinker with audio and vision encoders, talker,
token2wav DiT + BigVGAN); only widths and depths shrink. The sizes are the smallest that every
implementation we check against accepts:

- head_dim 32: vLLM's CPU attention takes 32, 64, 80 and up;
- ``mrope_section`` sums to head_dim / 2 (Qwen2.5's multimodal rope splits the rotary half);
- the thinker keeps the published 152,064-row vocabulary: the talker reads the thinker's
  embeddings of ids beyond the tokenizer (its text bos/eos/pad 151859-151861 and the speakers'
  bos tokens), so they must exist;
- BigVGAN keeps the published upsampling (5*3*2*2*2*2 = 240 samples a mel frame at 24 kHz) and
  three dilations per resblock;
- the DiT's ``num_embeds`` exceeds the talker's vocabulary: a random talker emits any of its
  8,448 ids, and the DiT's code embedding must take each.
"""

from __future__ import annotations

from typing import Any

# Qwen2.5-Omni's token ids (its tokenizer's special tokens), as its published config names them.
PAD_TOKEN_ID = 151643  # <|endoftext|>
IM_START_TOKEN_ID = 151644
IM_END_TOKEN_ID = 151645
AUDIO_TOKEN_ID = 151646
AUDIO_BOS_TOKEN_ID = 151647
AUDIO_EOS_TOKEN_ID = 151648
VISION_BOS_TOKEN_ID = 151652
VISION_EOS_TOKEN_ID = 151653
VISION_PAD_TOKEN_ID = 151654
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
TALKER_VOCAB_SIZE = 8448

HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 32
LAYERS = 2
ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
# The talker's heads are wider than hidden / heads, as the published talker's (896 wide, 12 heads of
# 128): a decoder that takes its head size from the width would not load it.
TALKER_HEAD_DIM = 48
TALKER_ROPE: dict[str, Any] = {**ROPE, "mrope_section": [6, 9, 9]}


def tiny_config_kwargs() -> dict[str, Any]:
    """Keyword arguments of ``transformers.Qwen2_5OmniConfig`` for the tiny checkpoint."""
    text = dict(vocab_size=152064, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                max_position_embeddings=32768, rope_parameters=dict(ROPE), tie_word_embeddings=False)
    audio = dict(num_mel_bins=128, encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                 d_model=HIDDEN, output_dim=HIDDEN, n_window=100, max_source_positions=1500)
    vision = dict(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=HEADS,
                  out_hidden_size=HIDDEN, fullatt_block_indexes=[LAYERS - 1], window_size=112, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision,
                   audio_token_index=AUDIO_TOKEN_ID, image_token_index=IMAGE_TOKEN_ID,
                   video_token_index=VIDEO_TOKEN_ID, vision_start_token_id=VISION_BOS_TOKEN_ID,
                   vision_end_token_id=VISION_EOS_TOKEN_ID, vision_token_id=VISION_PAD_TOKEN_ID,
                   bos_token_id=IM_START_TOKEN_ID, eos_token_id=IM_END_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    talker = dict(vocab_size=TALKER_VOCAB_SIZE, embedding_size=HIDDEN, hidden_size=HIDDEN,
                  intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=TALKER_HEAD_DIM, rope_parameters=dict(TALKER_ROPE))
    dit = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, head_dim=HEAD_DIM, ff_mult=2,
               emb_dim=32, look_ahead_layers=[1], look_backward_layers=[0], num_embeds=TALKER_VOCAB_SIZE + 1,
               mel_dim=80, enc_emb_dim=32, enc_dim=32, enc_channels=[32, 32, 32, 32, 96],
               enc_attention_channels=16, enc_se_channels=16)
    bigvgan = dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    return dict(thinker_config=thinker, talker_config=talker,
                token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))
