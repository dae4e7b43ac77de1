"""Gradient accumulation on a CUDA GPU: FastSFT's 4 micro-batches of 1 packed row update the LoRA weights as one
batch of 4 rows does, in fp32 (1e-4) and bf16 (3e-2); the tolerances are argued in tests/test_gradient_accumulation.py."""

from __future__ import annotations

import pytest
import torch

from tests.test_gradient_accumulation import assert_same_training

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-4), ("bf16", 3e-2)])
def test_accumulation_equals_a_larger_batch_on_the_gpu(tmp_path, dtype, tolerance):
    errors = assert_same_training(tmp_path, tolerance, device="cuda", dtype=dtype)
    print(f"{dtype}: largest relative weight error {max(errors.values()):.2e}")
