"""Decoding in one place: ``chat`` and ``generate_answers`` (the entry points), the one generation config, the
chooser, and one module per path, each with ``check`` (None, or why the path does not apply), ``prepare`` (make or
keep what it needs) and ``generate``.

- ``config``: ``GenerationSettings`` (greedy or sampling, the seed) and the transformers configs built from it.
- ``choose``: the path for a call (dense, then graphed, then ``generate``) and the decoders kept beside each model.
- ``dense`` (+ ``dense_weights``, ``dense_step``): a dense merged copy of the weights, one captured step.
- ``graphed``: the model's own step replayed from captured graphs.
- ``plain``: ``model.generate``.
- ``sampler``: the draws on the device (``nbkit.ops.sampling``) a captured step reads.
- ``shared``: the reasons and signatures the paths share.
Every capture goes through a ``nbkit.ops.layer_graphs`` backend (CUDA graphs on a GPU, tapes in the CPU tests).
"""

from .chat import Answer, answer, chat, prompt_ids
from .choose import decoders_of, release_decoders
from .config import GenerationSettings, greedy_config

__all__ = ["Answer", "GenerationSettings", "answer", "chat", "decoders_of", "greedy_config", "prompt_ids",
           "release_decoders"]
