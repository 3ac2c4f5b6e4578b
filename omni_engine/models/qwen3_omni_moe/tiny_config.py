"""The architecture of the tiny Qwen3-Omni-MoE checkpoint: the published model's, shrunk.

Every sub-model keeps its real class and wiring (thinker: MoE text model with audio and vision
encoders; talker: MoE decoder with a shared expert and its code predictor; code2wav); only widths,
depths, expert counts and code groups shrink. Every special id is the published one, so stage
configs written for ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` (talker stop 2150, speakers 2301-2303) hold
for the tiny one. The sizes are the smallest every implementation we check against accepts:

- head_dim 32 everywhere a vLLM attention runs (its CPU attention takes 32, 64, 80 and up);
- the thinker's ``mrope_section`` sums to head_dim / 2, interleaved as published;
- the thinker keeps the published 152,064-row vocabulary (the talker reads the thinker's embeddings
  of the tts bos / eos / pad ids 151671-151673);
- the talker's vocabulary keeps the published 3,072 rows (its special ids sit at 2148-2157 and the
  speakers at 2301-2303); the code predictor's and code2wav's codebooks keep 2,048;
- 4 code groups a frame (published: 16): a frame is the first group from the talker plus three
  from the code predictor, so every path of the predictor runs;
- code2wav keeps the published upsampling (8*5*4*3 after 2*2: 1,920 samples a 12.5 Hz frame, 24 kHz).
"""

from __future__ import annotations

from typing import Any

# Qwen3-Omni's token ids, as its published config names them.
PAD_TOKEN_ID = 151643  # <|endoftext|>
IM_START_TOKEN_ID = 151644
IM_END_TOKEN_ID = 151645
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
AUDIO_START_TOKEN_ID = 151669
AUDIO_END_TOKEN_ID = 151670
TTS_PAD_TOKEN_ID = 151671
TTS_BOS_TOKEN_ID = 151672
TTS_EOS_TOKEN_ID = 151673
AUDIO_TOKEN_ID = 151675  # <|audio_pad|> (transformers' default 151646 is Qwen2.5-Omni's)

CODEC_PAD_ID = 2148
CODEC_BOS_ID = 2149
CODEC_EOS_ID = 2150
CODEC_NOTHINK_ID = 2155
CODEC_THINK_BOS_ID = 2156
CODEC_THINK_EOS_ID = 2157
SPEAKER_IDS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
TALKER_VOCAB_SIZE = 3072
CODEBOOK_SIZE = 2048
CODE_GROUPS = 4

HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 32
LAYERS = 2
# The thinker's text model has one layer more, so that the layer the talker accepts (its output) is
# past the deepstack layer that adds visual features (the first; as published: 24 is past 0-2).
# transformers hands the talker a layer's output before those features are added, vLLM's aux state
# (and vLLM-Omni's) after; past the deepstack layers the two are the same.
THINKER_LAYERS = 3
ACCEPT_HIDDEN_LAYER = 2
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5],
                        "interleaved": True, "mrope_interleaved": True}


def tiny_config_kwargs() -> dict[str, Any]:
    """Keyword arguments of ``transformers.Qwen3OmniMoeConfig`` for the tiny checkpoint."""
    text = dict(vocab_size=152064, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=THINKER_LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                max_position_embeddings=32768, rope_parameters=dict(ROPE), num_experts=EXPERTS,
                num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=HIDDEN, norm_topk_prob=True,
                tie_word_embeddings=False)
    audio = dict(num_mel_bins=128, encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                 d_model=HIDDEN, output_dim=HIDDEN, n_window=50, n_window_infer=800, conv_chunksize=500,
                 downsample_hidden_size=32, max_source_positions=1500)
    vision = dict(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=HEADS,
                  out_hidden_size=HIDDEN, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=2304, deepstack_visual_indexes=[1], image_size=768,
                  apply_vit_abs_pos_embed=True)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision,
                   audio_token_id=AUDIO_TOKEN_ID, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                   audio_start_token_id=AUDIO_START_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID,
                   position_id_per_seconds=13, tie_word_embeddings=False)
    predictor = dict(vocab_size=CODEBOOK_SIZE, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, num_code_groups=CODE_GROUPS,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    talker_text = dict(vocab_size=TALKER_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                       moe_intermediate_size=HIDDEN // 2, shared_expert_intermediate_size=HIDDEN,
                       norm_topk_prob=True, rope_parameters=dict(ROPE))
    talker = dict(code_predictor_config=predictor, text_config=talker_text, num_code_groups=CODE_GROUPS,
                  thinker_hidden_size=HIDDEN, accept_hidden_layer=ACCEPT_HIDDEN_LAYER, codec_eos_token_id=CODEC_EOS_ID,
                  codec_nothink_id=CODEC_NOTHINK_ID, codec_think_bos_id=CODEC_THINK_BOS_ID,
                  codec_think_eos_id=CODEC_THINK_EOS_ID, codec_pad_id=CODEC_PAD_ID, codec_bos_id=CODEC_BOS_ID,
                  audio_token_id=AUDIO_TOKEN_ID, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                  vision_start_token_id=VISION_START_TOKEN_ID, audio_start_token_id=AUDIO_START_TOKEN_ID,
                  position_id_per_seconds=13, speaker_id=dict(SPEAKER_IDS), spatial_merge_size=2)
    code2wav = dict(codebook_size=CODEBOOK_SIZE, hidden_size=HIDDEN, num_attention_heads=HEADS,
                    num_key_value_heads=HEADS, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                    num_quantizers=CODE_GROUPS, sliding_window=72, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=96)
    return dict(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                im_start_token_id=IM_START_TOKEN_ID, im_end_token_id=IM_END_TOKEN_ID,
                tts_pad_token_id=TTS_PAD_TOKEN_ID, tts_bos_token_id=TTS_BOS_TOKEN_ID,
                tts_eos_token_id=TTS_EOS_TOKEN_ID)
