"""For Unsloth's users: their SFT recipe in their own words, run by nbkit.

Porting one of Unsloth's notebooks means changing its imports::

    from unsloth import FastLanguageModel, is_bfloat16_supported   ->  from nbkit.unsloth import ...
    from unsloth.chat_templates import get_chat_template, ...      ->  from nbkit.unsloth.chat_templates import ...
    from trl import SFTTrainer, SFTConfig                          ->  from nbkit.unsloth import SFTTrainer, SFTConfig

- ``models``: ``FastLanguageModel`` / ``FastModel`` (``from_pretrained``, ``get_peft_model``, ``for_inference``,
  ``for_training``) over ``nbkit.loading``; ``is_bfloat16_supported``.
- ``training``: ``SFTTrainer`` (a ``FastSFT`` that reads Unsloth's trainer words), ``SFTConfig``,
  ``train_on_responses_only``.
- ``chat_templates``: ``get_chat_template`` by family name, ``standardize_sharegpt``, ``train_on_responses_only``.
- ``saving``: ``save_pretrained_merged``, ``save_pretrained_gguf``, ``push_to_hub_merged``, ``push_to_hub_gguf`` on the
  models ``FastLanguageModel`` returns, over ``nbkit.export``.

Imported lazily, like ``nbkit`` itself.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__ = ["FastLanguageModel", "FastModel", "is_bfloat16_supported", "SFTTrainer", "SFTConfig",
           "train_on_responses_only", "get_chat_template", "standardize_sharegpt", "standardize_data_formats"]

__getattr__ = lazy_exports(__name__, {
    "FastLanguageModel": ".models",
    "FastModel": ".models",
    "is_bfloat16_supported": ".models",
    "SFTTrainer": ".training",
    "SFTConfig": ".training",
    "train_on_responses_only": ".training",
    "get_chat_template": ".chat_templates",
    "standardize_sharegpt": ".chat_templates",
    "standardize_data_formats": ".chat_templates",
})
