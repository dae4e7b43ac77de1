"""Unsloth's Alpaca recipe (its Llama-3.1 8B "Alpaca" notebook: instruction / input / output rows formatted into the
Alpaca prompt with the eos token, trained on the whole text), written from the notebook and run by nbkit on the real
SmolLM2-135M-Instruct.

The test body follows the notebook cell by cell with only the imports changed, and these other lines (``# changed``):
the model name (the local SmolLM2 folder), the dataset (200 synthetic rows in alpaca-cleaned's form), ``max_steps``
(CI-sized), ``.to("cuda")`` (the model's device) and ``load_in_4bit`` (False: 4-bit matmuls on a CPU are too slow
for CI). Cells that only read GPU memory, and the ``if False:`` alternatives, are left out; the save cells run.
Checks: a training loss, an answer, the merged folder (``save_pretrained_merged``'s logit check passes) and llama.cpp
answering from the q4_k_m file.
"""

from __future__ import annotations

import math

import pytest
from unsloth_recipes import alpaca_rows, llama_cpp_answers

pytest_plugins = ["conftest_real_model", "unsloth_recipes"]
pytestmark = pytest.mark.slow


def test_alpaca_recipe_trains_merges_and_llama_cpp_answers(smollm2_fp32_dir, tmp_path, monkeypatch):
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

    alpaca_prompt = """Below is an instruction that describes a task, paired with an input that provides further context. \
Write a response that appropriately completes the request.

### Instruction:
{}

### Input:
{}

### Response:
{}"""

    EOS_TOKEN = tokenizer.eos_token # Must add EOS_TOKEN
    def formatting_prompts_func(examples):
        instructions = examples["instruction"]
        inputs       = examples["input"]
        outputs      = examples["output"]
        texts = []
        for instruction, input, output in zip(instructions, inputs, outputs):
            text = alpaca_prompt.format(instruction, input, output) + EOS_TOKEN
            texts.append(text)
        return { "text" : texts, }

    from datasets import Dataset
    dataset = Dataset.from_list(alpaca_rows())  # changed: synthetic rows in alpaca-cleaned's form
    dataset = dataset.map(formatting_prompts_func, batched = True,)

    from nbkit.unsloth import SFTConfig, SFTTrainer
    trainer = SFTTrainer(
        model = model,
        tokenizer = tokenizer,
        train_dataset = dataset,
        dataset_text_field = "text",
        max_seq_length = max_seq_length,
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

    trainer_stats = trainer.train()

    FastLanguageModel.for_inference(model) # Enable native 2x faster inference
    inputs = tokenizer(
    [
        alpaca_prompt.format(
            "Continue the fibonacci sequence.", # instruction
            "1, 1, 2, 3, 5, 8", # input
            "", # output - leave this blank for generation!
        )
    ], return_tensors = "pt").to(model.device)  # changed: no GPU in CI

    outputs = model.generate(**inputs, max_new_tokens = 64, use_cache = True)
    tokenizer.batch_decode(outputs)

    model.save_pretrained("lora_model")  # Local saving
    tokenizer.save_pretrained("lora_model")

    model.save_pretrained_merged("model", tokenizer, save_method = "merged_16bit",)
    model.save_pretrained_gguf("model", tokenizer, quantization_method = "q4_k_m")
    # --- checks ---
    assert math.isfinite(trainer_stats.training_loss) and trainer_stats.global_step == 2
    assert "### Response:" in tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert outputs.shape[1] > inputs["input_ids"].shape[1]
    assert (tmp_path / "lora_model" / "adapter_config.json").is_file()
    assert (tmp_path / "model" / "model.safetensors").is_file()
    gguf = tmp_path / "model" / "model.Q4_K_M.gguf"
    assert gguf.is_file()
    assert llama_cpp_answers(gguf, inputs["input_ids"][0].tolist()), "llama.cpp generated nothing"
