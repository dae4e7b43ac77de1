"""Unsloth's Qwen3 recipe (its Qwen3 14B notebook: chats rendered with the model's chat template into a ``text``
column, ShareGPT data standardised, the trainer's words in ``SFTConfig``, answers sampled with thinking off), written
from the notebook and run by nbkit on the real SmolLM2-135M-Instruct. As the notebook does, it keeps the model's own
chat template (SmolLM2's ChatML, which ignores ``enable_thinking``); the ``qwen3`` template is tested in
``test_unsloth_compat.py``.

The test body follows the notebook cell by cell with only the imports changed, and these other lines (``# changed``):
the model name (the local SmolLM2 folder), ``load_in_4bit`` (False: 4-bit matmuls on a CPU are too slow for CI),
the two dataset lines as one (200 synthetic rows: half the notebook's reasoning form ``problem`` /
``generated_solution``, half FineTome's ShareGPT form), ``max_steps`` (CI-sized) and ``.to("cuda")``. The pandas
mixing cells are kept as the notebook has them. Cells that only read GPU memory and the ``if False:`` alternatives
are left out; the save cells run. Checks: a training loss, the notebook's answer (its temperature, top_p, top_k),
the merged folder and llama.cpp answering from q4_k_m.
"""

from __future__ import annotations

import math

import pytest
from unsloth_recipes import alpaca_rows, llama_cpp_answers, sharegpt_rows

pytest_plugins = ["conftest_real_model", "unsloth_recipes"]
pytestmark = pytest.mark.slow


def qwen3_datasets():
    """The notebook's two datasets, synthetic: the reasoning form (``problem``, ``generated_solution``) and
    FineTome's ShareGPT form, 100 rows each."""
    from datasets import Dataset

    reasoning = Dataset.from_list([{"problem": r["instruction"] + " " + r["input"],
                                    "generated_solution": r["output"]} for r in alpaca_rows(100)])
    return reasoning, Dataset.from_list(sharegpt_rows(100))


def test_qwen3_recipe_trains_merges_and_llama_cpp_answers(smollm2_fp32_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # --- the notebook, imports changed ---
    from nbkit.unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name = str(smollm2_fp32_dir),  # changed: the local model
        max_seq_length = 2048,   # Context length - can be longer, but uses more memory
        load_in_4bit = False,    # changed: 4-bit matmuls on a CPU are too slow for CI
        load_in_8bit = False,    # A bit more accurate, uses 2x memory
        full_finetuning = False, # We have full finetuning now!
    )

    model = FastLanguageModel.get_peft_model(
        model,
        r = 32,           # Choose any number > 0! Suggested 8, 16, 32, 64, 128
        target_modules = ["q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj",],
        lora_alpha = 32,  # Best to choose alpha = rank or rank*2
        lora_dropout = 0, # Supports any, but = 0 is optimized
        bias = "none",    # Supports any, but = "none" is optimized
        use_gradient_checkpointing = "unsloth", # True or "unsloth" for very long context
        random_state = 3407,
        use_rslora = False,   # We support rank stabilized LoRA
        loftq_config = None,  # And LoftQ
    )

    reasoning_dataset, non_reasoning_dataset = qwen3_datasets()  # changed: both synthetic, not the Hub

    def generate_conversation(examples):
        problems  = examples["problem"]
        solutions = examples["generated_solution"]
        conversations = []
        for problem, solution in zip(problems, solutions):
            conversations.append([
                {"role" : "user",      "content" : problem},
                {"role" : "assistant", "content" : solution},
            ])
        return { "conversations": conversations, }

    reasoning_conversations = tokenizer.apply_chat_template(
        list(reasoning_dataset.map(generate_conversation, batched = True)["conversations"]),
        tokenize = False,
    )

    from nbkit.unsloth.chat_templates import standardize_sharegpt
    dataset = standardize_sharegpt(non_reasoning_dataset)

    non_reasoning_conversations = tokenizer.apply_chat_template(
        list(dataset["conversations"]),
        tokenize = False,
    )

    chat_percentage = 0.75

    import pandas as pd
    non_reasoning_subset = pd.Series(non_reasoning_conversations)
    non_reasoning_subset = non_reasoning_subset.sample(
        int(len(reasoning_conversations) * (1.0 - chat_percentage)),
        random_state = 2407,
    )

    data = pd.concat([
        pd.Series(reasoning_conversations),
        pd.Series(non_reasoning_subset)
    ])
    data.name = "text"

    from datasets import Dataset
    combined_dataset = Dataset.from_pandas(pd.DataFrame(data))
    combined_dataset = combined_dataset.shuffle(seed = 3407)

    from nbkit.unsloth import SFTConfig, SFTTrainer
    trainer = SFTTrainer(
        model = model,
        tokenizer = tokenizer,
        train_dataset = combined_dataset,
        eval_dataset = None, # Can set up evaluation!
        args = SFTConfig(
            dataset_text_field = "text",
            per_device_train_batch_size = 2,
            gradient_accumulation_steps = 4, # Use GA to mimic batch size!
            warmup_steps = 5,
            max_steps = 2,  # changed: CI-sized
            learning_rate = 2e-4, # Reduce to 2e-5 for long training runs
            logging_steps = 1,
            optim = "adamw_8bit",
            weight_decay = 0.001,
            lr_scheduler_type = "linear",
            seed = 3407,
            report_to = "none", # Use TrackIO/WandB etc
            padding_free  = False, # Set to True if > 17 GB VRAM
        ),
    )

    trainer_stats = trainer.train()

    messages = [
        {"role" : "user", "content" : "Solve (x + 2)^2 = 0."}
    ]
    text = tokenizer.apply_chat_template(
        messages,
        tokenize = False,
        add_generation_prompt = True, # Must add for generation
        enable_thinking = False, # Disable thinking
    )

    from transformers import TextStreamer
    _ = model.generate(
        **tokenizer(text, return_tensors = "pt").to(model.device),  # changed: no GPU in CI
        max_new_tokens = 32, # Increase for longer outputs!
        temperature = 0.7, top_p = 0.8, top_k = 20, # For non thinking
        streamer = TextStreamer(tokenizer, skip_prompt = True),
    )

    model.save_pretrained_merged("model", tokenizer, save_method = "merged_16bit")
    model.save_pretrained_gguf("model", tokenizer, quantization_method = "q4_k_m")
    # --- checks ---
    assert len(combined_dataset) == 125 and text.endswith("<|im_start|>assistant\n")
    assert math.isfinite(trainer_stats.training_loss) and trainer_stats.global_step == 2
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert _.shape[1] > len(prompt_ids)
    gguf = tmp_path / "model" / "model.Q4_K_M.gguf"
    assert (tmp_path / "model" / "model.safetensors").is_file() and gguf.is_file()
    assert llama_cpp_answers(gguf, prompt_ids), "llama.cpp generated nothing"
