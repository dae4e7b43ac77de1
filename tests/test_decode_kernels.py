"""``nbkit.ops.decode_kernels``: each Triton kernel against its torch reference, and the dense decoder run through
the kernels against ``generate``, on a CPU under ``TRITON_INTERPRET=1`` (in a subprocess: the
interpreter must be on before triton is imported).

Tolerances, stated: float32, 2e-6 (the kernels sum in another order); float16, 2 units of the last place of the
output's scale (each op rounds once where the reference rounds per torch op). bfloat16 is left to the GPU twin
(tests/gpu/test_dense_decode_gpu.py): the interpreter's bfloat16 ``tl.dot`` is not faithful. The decoder through
the kernels must give ``generate``'s greedy tokens exactly in float32 (qwen3 with q/k norms and its attention split
over programs and combined, llama without norms in one program; a left-padded batch and one row).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nbkit.decode.dense import DenseDecoder
from nbkit.ops import decode_kernels as K

_SCRIPT = textwrap.dedent(
    """
    import torch
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

    # the decoder through the kernels, against generate, float32
    from nbkit.chat import greedy_config, prompt_ids
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.decode.dense import DenseDecoder
    from peft import LoraConfig, get_peft_model

    tok = load_demo_tokenizer()
    for family, programs in (("qwen3", 128), ("llama", 1)):  # split over programs and combined; one program
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
        K.PROGRAMS, K.MIN_SPLIT = programs, 64
        decoder = DenseDecoder(graphs=False, kernels="triton")
        got = decoder.generate(model, batch["input_ids"], config, batch["attention_mask"])
        assert decoder.uses_triton()
        assert decoder._states[2][0].split == (64 if programs > 1 else 512)
        assert got == want, (family, got, want)
        one = batch["input_ids"][1:]
        assert decoder.generate(model, one, config) == want[1:], (family, "one row")
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


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype):
    """Each kernel, in each branch its constexprs select, through Triton's whole compiler for sm_90: what the
    interpreter does not check (types across branches, tile shapes ``tl.dot`` takes)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    p, target = "*" + dtype, GPUTarget("cuda", 90, 32)
    tiles = dict(G=2, GP=16, D=128, SPLIT=128, BLOCK_N=64, PRECISION="ieee" if dtype == "fp32" else "tf32")
    cases = [(K._rms_norm_kernel, dict(x_ptr=p, w_ptr=p, out_ptr=p, n="i32", eps="fp32"), dict(BLOCK=2048)),
             (K._combine_kernel, dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr=p),
              dict(G=2, GP=16, D=128, S=3, SP=4)),
             (K._silu_mul_kernel, dict(gu_ptr=p, out_ptr=p, n="i32"), dict(BLOCK=1024))]
    for norm in (True, False):
        cases.append((K._qk_rope_cache_kernel, dict(qkv_ptr=p, q_ptr=p, k_ptr=p, v_ptr=p, qn_ptr=p, kn_ptr=p,
                                                    cos_ptr=p, sin_ptr=p, pos_ptr="*i64", slot_ptr="*i64", H="i32",
                                                    KV="i32", cap="i32", eps="fp32"),
                      dict(D=128, HALF=64, NORM=norm)))
    for s in (1, 4):
        part = "*fp32" if s > 1 else p
        cases.append((K._decode_attention_kernel, dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr=p, slot_ptr="*i64",
                                                       out_ptr=p, m_ptr=part, l_ptr=part, acc_ptr=part, KV="i32",
                                                       cap="i32", scaling="fp32"), dict(tiles, S=s)))
    for fn, signature, constants in cases:
        signature = dict(signature, **{name: "constexpr" for name in constants})
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=target)


def test_head_sizes_the_kernels_take():
    if not K.HAS_TRITON:
        assert not K.supported(128)
        return
    assert all(K.supported(d) for d in (16, 32, 64, 128, 256))
    assert not any(K.supported(d) for d in (8, 80, 96, 512))


def test_splits_and_the_kernels_switch():
    assert K.splits_for(512, 256) == 2 and K.splits_for(513, 256) == 3 and K.splits_for(100, 256) == 1
    assert K.split_for(8, 512) == 128  # one row, 8 kv heads: 4 splits of 128 keys
    assert K.split_for(256, 512) == 512  # 32 rows fill the GPU: one program a row and head, no combine
    assert K.split_for(8, 4096) == 256 and K.split_for(1, 100) == 128  # 16 splits; a short buffer in one
    assert K.split_for(8, 600) % 64 == 0 and K.splits_for(600, K.split_for(8, 600)) == 4
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
