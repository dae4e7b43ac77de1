"""The graph engine's scenarios (tests/test_layer_graphs.py) on real CUDA graphs: replays match the eager module,
Python runs only at capture (the same stale read the tape shows on a CPU), unreached parameters fail the capture, a
second forward before its backward is refused, a capture cut in segments replays with its eager parts between.
Same code, same assertions: the tape the CPU tests run on behaves as
a CUDA graph does. fp32, TF32 off: eager and replay to torch's default fp32 tolerances. Not here: a host read inside
a capture (the tape refuses it by name); a CUDA capture that fails part-way leaves torch's CUDA generator unusable
for the rest of the process ("Offset increment outside graph capture"), which would break every later test."""

from __future__ import annotations

import pytest
import torch

from tests.test_layer_graphs import CHECKS, check_a_host_read_of_a_device_value_fails_the_capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("check", [c for c in CHECKS if c is not check_a_host_read_of_a_device_value_fails_the_capture],
                         ids=lambda c: c.__name__[6:])
def test_on_cuda_graphs(check):
    from nbkit.ops.layer_graphs import CudaGraphBackend

    check(CudaGraphBackend(), "cuda")
