"""Qwen3-Omni's code predictor (``code_predictor.predict_codes``) against transformers' own ``generate``
of the same module, as transformers' talker calls it for each frame."""

from __future__ import annotations

import pytest
import torch

from omni_engine.models.qwen3_omni_moe.code_predictor import build_code_predictor, predict_codes
from omni_engine.models.qwen3_omni_moe.tiny_config import tiny_config_kwargs

FRAMES = 6


def predictor(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny checkpoint's predictor layout (GQA: 2 heads, 1 KV head) with seeded weights wide
    enough that its logits are far apart (greedy codes then do not hang on float order)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_code_predictor(tiny_config_kwargs()["talker_config"]["code_predictor_config"])
        for name, weight in module.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(weight, std=0.3)
    return module.to(dtype)


def frames(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    width = tiny_config_kwargs()["talker_config"]["code_predictor_config"]["hidden_size"]
    return (torch.randn(FRAMES, width, generator=generator, dtype=dtype),
            torch.randn(FRAMES, width, generator=generator, dtype=dtype))


@torch.no_grad()
def transformers_frames(module: torch.nn.Module, hidden: torch.Tensor, first: torch.Tensor):
    """Codes 1.. and summed embeddings as transformers' talker gets them: ``generate`` per frame."""
    groups = len(module.lm_head) + 1
    codes, summed = [], []
    for row in range(hidden.shape[0]):
        result = module.generate(inputs_embeds=torch.stack([hidden[row], first[row]]).unsqueeze(0),
                                 max_new_tokens=groups - 1, do_sample=False, output_hidden_states=True,
                                 return_dict_in_generate=True)
        middle = [step[0] for step in result.hidden_states[1:]]
        last = module.get_input_embeddings()[-1](result.sequences[..., -1:])
        codes.append(result.sequences[0])
        summed.append(torch.cat([first[row].view(1, 1, -1), *middle, last], dim=1).sum(1)[0])
    return torch.stack(codes), torch.stack(summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_batch_of_frames_gives_transformers_codes_and_summed_embeddings(dtype):
    module = predictor(0, dtype)
    hidden, first = frames(dtype)
    codes, summed = predict_codes(module, hidden, first, [False] * FRAMES)
    want_codes, want_summed = transformers_frames(module, hidden, first)
    assert codes.tolist() == want_codes.tolist()
    assert len({tuple(row) for row in codes.tolist()}) > 1, "every frame the same codes: the check proves little"
    torch.testing.assert_close(summed, want_summed, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_weights_loaded_in_place_after_the_first_frames_are_the_ones_it_predicts_with():
    """The fused q/k/v and gate/up weights are the modules' own storage: a weight update loaded in
    place (load_state_dict, as the talker's load_weights does) reaches them, and a dtype move makes
    them again."""
    module = predictor(0)
    hidden, first = frames()
    before, _ = predict_codes(module, hidden, first, [False] * FRAMES)
    module.load_state_dict(predictor(1).state_dict())
    after, summed = predict_codes(module, hidden, first, [False] * FRAMES)
    fresh = predictor(1)
    assert after.tolist() == predict_codes(fresh, hidden, first, [False] * FRAMES)[0].tolist()
    assert after.tolist() != before.tolist(), "the two seeds' predictors agree: the check proves nothing"
    assert after.tolist() == transformers_frames(fresh, hidden, first)[0].tolist()
    module.double()
    hidden64, first64 = hidden.double(), first.double()
    assert predict_codes(module, hidden64, first64, [False] * FRAMES)[0].tolist() == \
        transformers_frames(module, hidden64, first64)[0].tolist()
