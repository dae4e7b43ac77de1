"""Unsloth's conversational recipe (its Llama-3.2 1B/3B "Conversational" notebook: ShareGPT data, the llama-3.1 chat
template, ``train_on_responses_only``), written from the notebook and run by nbkit on the real SmolLM2-135M-Instruct.

The test body follows the notebook cell by cell with only the imports changed, and these other lines (``# changed``):
the model name (the local SmolLM2 folder), the dataset (200 synthetic rows in FineTome's ShareGPT form, not the Hub),
``max_steps`` (CI-sized), ``.to("cuda")`` (the model's device: CI has no GPU) and ``load_in_4bit`` (False: 4-bit
matmuls on a CPU are too slow for CI). Cells that only read GPU memory, and the ``if False:`` alternatives,
are left out; the save cells run. Checks: the masked labels, a training loss, the notebook's answer (its temperature
and min_p sample where the model's generation config samples; SmolLM2's is greedy), the merged folder
(``save_pretrained_merged``'s own logit check passes), and llama.cpp answering from the q4_k_m file.
"""

from __future__ import annotations

import math

import pytest
import torch
from unsloth_recipes import llama_cpp_answers, sharegpt_rows

pytest_plugins = ["conftest_real_model", "unsloth_recipes"]
pytestmark = pytest.mark.slow


def test_conversational_recipe_trains_chats_merges_and_llama_cpp_answers(smollm2_fp32_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # --- the notebook, imports changed ---
    from nbkit.unsloth import FastLanguageModel
    max_seq_length = 2048 # Choose any! We auto support RoPE Scaling internally!
    dtype = None # None for auto detection. Float16 for Tesla T4, V100, Bfloat16 for Ampere+
    load_in_4bit = False  # changed: 4-bit matmuls on a CPU are too slow for CI (the GPU path is 4-bit)

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name = str(smollm2_fp32_dir),  # changed: the local model
        max_seq_length = max_seq_length,
        dtype = dtype,
        load_in_4bit = load_in_4bit,
    )

    model = FastLanguageModel.get_peft_model(
        model,
        r = 16,
        target_modules = ["q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj",],
        lora_alpha = 16,
        lora_dropout = 0,
        bias = "none",
        use_gradient_checkpointing = "unsloth",
        random_state = 3407,
        use_rslora = False,
        loftq_config = None,
    )

    from nbkit.unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(
        tokenizer,
        chat_template = "llama-3.1",
    )

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [tokenizer.apply_chat_template(convo, tokenize = False, add_generation_prompt = False) for convo in convos]
        return { "text" : texts, }

    from datasets import Dataset
    dataset = Dataset.from_list(sharegpt_rows())  # changed: synthetic rows in FineTome's form

    from nbkit.unsloth.chat_templates import standardize_sharegpt
    dataset = standardize_sharegpt(dataset)
    dataset = dataset.map(formatting_prompts_func, batched = True,)

    from transformers import DataCollatorForSeq2Seq

    from nbkit.unsloth import SFTConfig, SFTTrainer
    trainer = SFTTrainer(
        model = model,
        tokenizer = tokenizer,
        train_dataset = dataset,
        dataset_text_field = "text",
        max_seq_length = max_seq_length,
        data_collator = DataCollatorForSeq2Seq(tokenizer = tokenizer),
        packing = False, # Can make training 5x faster for short sequences.
        args = SFTConfig(
            per_device_train_batch_size = 2,
            gradient_accumulation_steps = 4,
            warmup_steps = 5,
            max_steps = 2,  # changed: CI-sized
            learning_rate = 2e-4,
            logging_steps = 1,
            optim = "adamw_8bit",
            weight_decay = 0.001,
            lr_scheduler_type = "linear",
            seed = 3407,
            output_dir = "outputs",
            report_to = "none", # Use TrackIO/WandB etc
        ),
    )

    from nbkit.unsloth.chat_templates import train_on_responses_only
    trainer = train_on_responses_only(trainer)

    row = trainer.train_dataset[5]
    kept = tokenizer.decode([x for x in row["labels"] if x != -100])
    trainer_stats = trainer.train()

    FastLanguageModel.for_inference(model) # Enable native 2x faster inference

    messages = [
        {"role": "user", "content": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"},
    ]
    inputs = tokenizer.apply_chat_template(
        messages,
        tokenize = True,
        add_generation_prompt = True, # Must add for generation
        return_tensors = "pt",
    ).to(model.device)  # changed: no GPU in CI

    outputs = model.generate(input_ids = inputs, max_new_tokens = 64, use_cache = True,
                             temperature = 1.5, min_p = 0.1)
    tokenizer.batch_decode(outputs)

    model.save_pretrained_merged("llama_finetune_16bit", tokenizer, save_method = "merged_16bit",)
    model.save_pretrained_gguf("llama_finetune", tokenizer, quantization_method = "q4_k_m")
    # --- checks ---
    assert "Describe" not in kept and "calm" in kept and "<|eot_id|>" in kept  # answers (and their end) only
    prompt = tokenizer.decode(row["input_ids"])
    assert "<|start_header_id|>user<|end_header_id|>" in prompt and "Describe" in prompt
    assert math.isfinite(trainer_stats.training_loss) and trainer_stats.global_step == 2
    prompt_ids = inputs["input_ids"]  # transformers 5: a BatchEncoding (the notebook's transformers 4: a tensor)
    assert outputs.shape[1] > prompt_ids.shape[1] and torch.equal(outputs[0, :prompt_ids.shape[1]], prompt_ids[0])
    assert (tmp_path / "llama_finetune_16bit" / "model.safetensors").is_file()
    gguf = tmp_path / "llama_finetune" / "llama_finetune.Q4_K_M.gguf"
    assert gguf.is_file()
    answer = llama_cpp_answers(gguf, prompt_ids[0].tolist())
    assert answer, "llama.cpp generated nothing"
