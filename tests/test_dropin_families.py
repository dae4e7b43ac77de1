"""The drop-in contract across model families: dense (Qwen3, Llama), MoE (Qwen3-MoE), gpt-oss, the hybrids with
short-convolution or Mamba-2 mixers (LFM2, Nemotron-H, Falcon-H1), and families whose packed attention nbkit has not
validated (OLMo 3, Cohere 2, GPT-NeoX, GLM-4-MoE: FastSFT must then be SFTTrainer exactly) train under FastSFT as
under SFTTrainer.

Each family is a tiny randomly initialised model of its real architecture (``dropin.tiny``); the hybrids run on
transformers' pure-torch mixers on a CPU (no ``causal_conv1d`` or ``mamba_ssm``). Both trainers run TRL's defaults
(no packing) and, for the families TRL can pack, ``packing=True``. Tolerance: ``dropin.LOSS_TOL`` (1e-5 relative,
fp32), except MoE families, whose experts nbkit runs sorted by expert (``fast_moe_routing``: the same products summed
in another order, then through a router whose top-k can amplify a last-bit difference over steps): ``MOE_TOL``,
1e-4 relative. gpt-oss packed is not compared on losses: plain transformers lets its packed documents attend to each
other on the sdpa path and FastSFT keeps them apart, by design (README, Limits); that run is held to training alike.
"""

from __future__ import annotations

import pytest
from dropin import assert_same_outcome, assert_trains, both, dataset, tiny
from parity import Tol

MOE_TOL = Tol(rtol=1e-4, atol=1e-5)
FAMILIES = ["qwen3", "llama", "qwen3_moe", "gpt_oss", "lfm2", "nemotron_h", "falcon_h1", "olmo3", "cohere2", "gpt_neox",
            "glm4_moe"]
MOE = {"qwen3_moe", "gpt_oss", "nemotron_h", "glm4_moe"}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_alike_with_trl_defaults(one_thread, tmp_path, family):
    """Full fine-tuning, TRL's defaults (no packing, gradient checkpointing on), fp32 on both."""
    plain, fast = both(tmp_path, model=lambda tok: tiny(family, tok), max_steps=2, max_length=48)
    assert_trains(plain)
    assert_same_outcome(plain, fast, tol=MOE_TOL if family in MOE else Tol(rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_alike_packed(one_thread, tmp_path, family):
    """``packing=True`` (TRL's bfd: padding-free rows with position_ids). On a CPU without ``causal_conv1d`` /
    ``mamba_ssm``, transformers refuses packed rows for the conv/SSM hybrids (a ``ValueError`` at the first step):
    FastSFT must fail alike there, not differently."""
    plain, fast = both(tmp_path, model=lambda tok: tiny(family, tok), max_steps=2, max_length=48, packing=True)
    if family == "gpt_oss":
        assert_trains(plain)
        assert_trains(fast)
        return
    assert_same_outcome(plain, fast, tol=MOE_TOL if family in MOE else Tol(rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("family", ["qwen3_moe", "lfm2"])
def test_lora_on_moe_and_hybrid_families_trains_alike(one_thread, tmp_path, family):
    from peft import LoraConfig

    plain, fast = both(tmp_path, model=lambda tok: tiny(family, tok),
                       extra=lambda tok: {"peft_config": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                    target_modules="all-linear")},
                       max_steps=2, max_length=48, data=lambda: dataset("messages"), assistant_only_loss=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast, tol=MOE_TOL if family in MOE else Tol(rtol=1e-5, atol=1e-6))
