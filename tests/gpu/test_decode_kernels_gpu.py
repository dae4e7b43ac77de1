"""``nbkit.ops.decode_kernels`` on a CUDA GPU: each Triton kernel against its torch reference in bfloat16 and
float32, at the 1.7B Qwen3 shapes, and the dense decoder through the kernels against the same
decoder in torch.

Tolerances, stated: float32, 1e-5 relative to the output's scale (another summation order); bfloat16, 2 units of
the last place of the output's scale for the elementwise kernels (one rounding where the reference rounds per op)
and 1% of the scale for attention (probabilities rounded to bfloat16 before the value product). Decoders: the
logits of one captured step from the same prompt within 1e-4 (float32) or 3% (bfloat16) of their scale; in float32
also 40 tokens equal and the last logits close.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ELEMENTWISE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-7}
REDUCED = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LOGITS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _close(got, want, tol, what):
    scale = max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, (what, err, tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_ops_match_their_references(dtype):
    from nbkit.ops import decode_kernels as K

    torch.manual_seed(0)
    b, h, kv, d = 2, 16, 8, 128
    for cap in (512, 4096):
        qkv = torch.randn(b, (h + 2 * kv) * d, dtype=dtype, device="cuda")
        cos, sin = torch.randn(cap, d, dtype=dtype, device="cuda"), torch.randn(cap, d, dtype=dtype, device="cuda")
        pos = torch.tensor([3, cap - 20], device="cuda")
        slot = torch.tensor([cap - 20], device="cuda")
        qn, kn = (torch.rand(d, device="cuda") + 0.5).to(dtype), (torch.rand(d, device="cuda") + 0.5).to(dtype)
        keys = torch.randn(b, kv, cap, d, dtype=dtype, device="cuda")
        values = torch.randn_like(keys)
        keys2, values2 = keys.clone(), values.clone()
        q = K.qk_rope_cache(qkv, keys, values, qn, kn, cos, sin, pos, slot, h, 1e-6, False)
        q2 = K.qk_rope_cache(qkv, keys2, values2, qn, kn, cos, sin, pos, slot, h, 1e-6, True)
        _close(q2, q, ELEMENTWISE[dtype], "queries")
        _close(keys2, keys, ELEMENTWISE[dtype], "keys")
        assert torch.equal(values2, values)
        mask = torch.zeros(b, cap, dtype=dtype, device="cuda")
        mask[:, slot.item() + 1:] = torch.finfo(dtype).min
        mask[0, :300] = torch.finfo(dtype).min  # a left-padded row
        for split in (None, 128, 1024):
            got = K.decode_attention(q, keys, values, mask, slot, d ** -0.5, True, split=split)
            _close(got, K.decode_attention(q, keys, values, mask, slot, d ** -0.5, False), REDUCED[dtype],
                   f"attention {cap} {split}")
    x, w = torch.randn(3, 2048, dtype=dtype, device="cuda"), (torch.rand(2048, device="cuda") + 0.5).to(dtype)
    _close(K.rms_norm(x, w, 1e-6, True), K.rms_norm(x, w, 1e-6, False), ELEMENTWISE[dtype], "rms_norm")
    gu = torch.randn(3, 2 * 6144, dtype=dtype, device="cuda")
    _close(K.silu_mul(gu, True), K.silu_mul(gu, False), ELEMENTWISE[dtype], "silu_mul")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decoder_through_the_kernels_is_the_decoder_in_torch(dtype):
    from nbkit.chat import greedy_config, prompt_ids
    from nbkit.decode.dense import DenseDecoder
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), dtype=dtype, pad_token_id=tok.pad_token_id, eos_token_id=None,
                       hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_hidden_layers=4).cuda().eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, tok.pad_token_id
    ids = prompt_ids(tok, [{"role": "user", "content": "Tell me about the sea."}], torch.device("cuda"))
    fast, plain = DenseDecoder(), DenseDecoder(kernels="torch")
    for n in (2, 40):  # 2: one captured step after the prompt, from the same keys, values and token
        got, want = fast.generate(model, ids, greedy_config(model, tok, n)), plain.generate(
            model, ids, greedy_config(model, tok, n))
        if n == 2 or dtype == torch.float32:
            _close(fast._states[1][0].logits, plain._states[1][0].logits, LOGITS[dtype], f"logits after {n}")
    assert fast.uses_triton() and not plain.uses_triton()
    if dtype == torch.float32:
        assert got == want
