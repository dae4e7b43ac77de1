"""``nbkit.ops.decode_kernels`` and ``decode_gemv``: each Triton kernel against its torch reference, and the dense
decoder run through the kernels against ``generate``, on a CPU under ``TRITON_INTERPRET=1`` (in a subprocess: the
interpreter must be on before triton is imported).

Tolerances, stated: float32, 2e-6 (the kernels sum in another order); float16, 2 units of the last place of the
output's scale (each op rounds once where the reference rounds per torch op). bfloat16 is left to the GPU twin
(tests/gpu/test_dense_decode_gpu.py): the interpreter's bfloat16 ``tl.dot`` is not faithful. The decoder through
the kernels must give ``generate``'s greedy tokens exactly in float32 (qwen3 with q/k norms and its attention split
over programs and combined, llama without norms in one program; a left-padded batch, and one row through the fused
one-row matmuls).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nbkit.dense_decode import DenseDecoder
from nbkit.ops import decode_kernels as K

_SCRIPT = textwrap.dedent(
    """
    import torch
    from nbkit.ops import decode_gemv as G
    from nbkit.ops import decode_kernels as K

    def close(a, b, dtype, what):
        tol = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * max(1.0, b.float().abs().max().item())
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol, (what, dtype, err, tol)

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for b, h, kv, d, cap in ((3, 8, 2, 64, 600), (1, 4, 4, 128, 96), (2, 8, 2, 32, 40)):
            qkv = torch.randn(b, (h + 2 * kv) * d, dtype=dtype)
            cos, sin = torch.randn(cap, d, dtype=dtype), torch.randn(cap, d, dtype=dtype)
            pos, slot = torch.randint(0, cap, (b,)), torch.tensor([cap - 9])
            for norm in (True, False):
                qn = (torch.rand(d) + 0.5).to(dtype) if norm else None
                kn = (torch.rand(d) + 0.5).to(dtype) if norm else None
                keys, values = torch.randn(b, kv, cap, d, dtype=dtype), torch.randn(b, kv, cap, d, dtype=dtype)
                keys2, values2 = keys.clone(), values.clone()
                q = K.qk_rope_cache(qkv, keys, values, qn, kn, cos, sin, pos, slot, h, 1e-6, False)
                q2 = K.qk_rope_cache(qkv, keys2, values2, qn, kn, cos, sin, pos, slot, h, 1e-6, True)
                close(q2, q, dtype, "queries")
                close(keys2, keys, dtype, "keys")
                assert torch.equal(values2, values), "values"
            low = torch.finfo(dtype).min
            mask = torch.zeros(b, cap, dtype=dtype)
            mask[:, slot.item() + 1:] = low  # the future
            mask[-1, : min(70, slot.item())] = low  # a left-padded row: whole blocks and splits of it masked
            q = torch.randn(b, h, d, dtype=dtype)
            want = K.decode_attention(q, keys, values, mask, slot, d ** -0.5, False)
            for split in (1024, 256, 64):  # one program a row and head, and split over 3-10 programs
                got = K.decode_attention(q, keys, values, mask, slot, d ** -0.5, True, split=split)
                close(got, want, dtype, f"attention, split {split}")
        x, w = torch.randn(5, 300, dtype=dtype), (torch.rand(300) + 0.5).to(dtype)
        close(K.rms_norm(x, w, 1e-6, True), K.rms_norm(x, w, 1e-6, False), dtype, "rms_norm")
        gu = torch.randn(3, 2 * 1500, dtype=dtype)
        close(K.silu_mul(gu, True), K.silu_mul(gu, False), dtype, "silu_mul")
        for (n, k), programs in zip(((300, 520), (40, 64)), (16, 1)):  # rows and inputs off the blocks
            G.MIN_PROGRAMS = programs  # 32 and 8 rows a program (the interpreter is slow with many programs)
            w, bias, res = torch.randn(n, k, dtype=dtype) / 8, torch.randn(1, n, dtype=dtype), torch.randn(1, n, dtype=dtype)
            nw = (torch.rand(k) + 0.5).to(dtype)
            x, gx = torch.randn(1, k, dtype=dtype), torch.randn(1, 2 * k, dtype=dtype)
            for args in (dict(), dict(bias=bias[0]), dict(norm=nw), dict(norm=nw, bias=bias[0]), dict(residual=res),
                         dict(residual=res, bias=bias[0])):
                close(G.gemv(x, w, use_triton=True, **args), G.gemv(x, w, **args), dtype, f"gemv {sorted(args)}")
            close(G.gemv(gx, w, glu=True, residual=res, use_triton=True), G.gemv(gx, w, glu=True, residual=res),
                  dtype, "gemv glu")

    # the decoder through the kernels, against generate, float32
    import nbkit.ops.decode_kernels
    from nbkit.chat import greedy_config, prompt_ids
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.dense_decode import DenseDecoder
    from peft import LoraConfig, get_peft_model

    tok = load_demo_tokenizer()
    G.MIN_PROGRAMS = 1
    for family, split in (("qwen3", 8), ("llama", 256)):  # 8: attention split over programs and combined
        torch.manual_seed(0)
        model = tiny_model(family, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=None)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, None
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        tok.padding_side = "left"
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                 for q in ("hi", "Reverse the words: red fox moon and the sea")]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        config = greedy_config(model, tok, 12)
        want = model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:].tolist()
        nbkit.ops.decode_kernels.SPLIT = split
        decoder = DenseDecoder(graphs=False, kernels="triton")
        got = decoder.generate(model, batch["input_ids"], config, batch["attention_mask"])
        assert decoder.uses_triton()
        assert got == want, (family, split, got, want)
        one = batch["input_ids"][1:]  # one row: the fused one-row matmuls
        assert decoder.generate(model, one, config) == want[1:], (family, split, "one row")
    print("TRITON_OK")
    """
)


def test_kernels_match_their_references_and_decode_as_generate_interpreted():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "TRITON_OK" in proc.stdout, proc.stderr[-3000:]


def test_head_sizes_the_kernels_take():
    if not K.HAS_TRITON:
        assert not K.supported(128)
        return
    assert all(K.supported(d) for d in (16, 32, 64, 128, 256))
    assert not any(K.supported(d) for d in (8, 80, 96, 512))


def test_splits_and_the_kernels_switch():
    assert K.splits_for(512, 256) == 2 and K.splits_for(513, 256) == 3 and K.splits_for(100, 256) == 1
    assert not DenseDecoder(graphs=False).uses_triton()  # no copy yet
    with pytest.raises(ValueError, match="kernels must be"):
        DenseDecoder(kernels="cuda")


def test_references_are_transformers_arithmetic(one_thread):
    """The torch references are what transformers' modules compute (the kernels are held to them)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    x = torch.randn(4, 6, 64, dtype=torch.bfloat16)
    norm = Qwen3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert torch.equal(K.rms_norm_ref(x, norm.weight, 1e-6), norm(x))
    cos, sin = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 64, dtype=torch.bfloat16)
    q, k = apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    assert torch.equal(K.rotate(x, cos, sin), q[0])
