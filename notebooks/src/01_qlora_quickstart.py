# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/nbkit/nbkit/blob/main/notebooks/01_qlora_quickstart.ipynb)
#
# # QLoRA fine-tuning in one notebook, with nbkit
#
# Load a model in 4-bit with LoRA adapters, build a chat dataset with the model's own chat template, train with
# `nbkit.FastSFT` while the live dashboard shows speed, loss and memory, compare answers before and after, chat with
# the trained model (streamed), save the adapter, merge it into a 16-bit model, export a GGUF file for llama.cpp /
# Ollama (pure Python: nothing to build), and reload each to check it is what was trained.
#
# The task is nbkit's shipped demo: *reverse the words* (`"Reverse the words: red fox moon"` ->
# `"moon fox red"`). It is generated, so it needs no download, and scored on held-out prompts.

# %% [markdown]
# **Run it on Colab**: pick a GPU first: *Runtime > Change runtime type > T4 GPU* (the free one) and *Save*; then
# *Runtime > Run all*. The setup cell installs nbkit; if it asks for a restart, *Runtime > Restart session* and run
# all again. With `model_name="auto"` the notebook fine-tunes Qwen/Qwen3-1.7B in 4 bits on the GPU (a few minutes
# on a T4). On a CPU runtime (Colab's default) it still runs to the end, on a tiny randomly initialised model of
# the same architecture saved to a local folder with nbkit's demo tokenizer (the model cell says which it took):
# that shows every step working, not what fine-tuning teaches a real model; about three minutes on two cores. Both
# go through the same `nbkit.load_model(path)` call. The first code cell holds the parameters (tagged `parameters`,
# so papermill or nbclient can override them).

# %% tags=["parameters"]
# Parameters
model_name = "auto"  # "auto": Qwen/Qwen3-1.7B on a GPU, a tiny local qwen3 without one; "tiny"; a Hub id; a folder
load_in_4bit = True  # QLoRA: NF4 4-bit base + LoRA; False: a 16-bit base + LoRA
lora_r = 16
# Training; None takes the value for the model: 60 steps of 4 rows x 512 tokens at 2e-4 for a pretrained one, and
# for the tiny random-init one the demo's recipe, 300 steps of 2 rows x 256 tokens at 3e-3 (it learns the skill
# after 100-200 steps, however many tokens a step holds)
max_steps = None
max_length = None  # tokens per packed row
batch_size = None  # packed rows per step
learning_rate = None
train_examples = 2000
eval_examples = 16  # held-out prompts scored before and after
own_data = None  # path of your JSONL file, one {"messages": [...]} per line, to train on instead of the demo
gguf_quant = "q8_0"  # GGUF type: q8_0, q6_k, q5_k_m, q4_k_m (llama.cpp's usual), f16... (nbkit.export.QUANT_TYPES)
output_dir = "nbkit-out/01_qlora_quickstart"  # everything this notebook writes goes here
nbkit_source = "nbkit-sft @ git+https://github.com/nbkit/nbkit"  # what setup installs: this, a wheel or a checkout
run_setup = "auto"  # "auto": run colab_setup.sh on Colab/Kaggle only; True: always; False: never
setup_options = []  # more colab_setup.sh options: ["--flash"] adds flash-attn if a prebuilt wheel fits
seed = 0

# %%
# Setup. On Colab or Kaggle: install nbkit without touching the runtime's torch. nbkit goes in alone first
# (--no-deps: nothing is resolved, so nothing can replace torch), then its colab_setup.sh pins torch and
# installs the rest. Its distribution is named nbkit-sft (the import stays `nbkit`): "nbkit" on PyPI is another
# project, whose files would shadow these, so a distribution of that name is removed first. Elsewhere (your
# machine, CI) this cell does nothing: pip install "nbkit-sft[notebooks] @ git+https://github.com/nbkit/nbkit" yourself.
import importlib, os, subprocess, sys
from importlib import metadata


def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


hosted = any(os.environ.get(v) for v in ("COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE",
                                         "KAGGLE_URL_BASE"))
if run_setup is True or (run_setup == "auto" and hosted):
    dry_run = "--dry-run" in setup_options  # print the pip commands, run none
    pip = []
    if installed("nbkit"):
        print(f"a distribution named 'nbkit' ({installed('nbkit')}) is installed: this project's is nbkit-sft, "
              "so it is removed first")
        pip.append(["uninstall", "-y", *(n for n in ("nbkit", "nbkit-sft") if installed(n))])
    if pip or not installed("nbkit-sft"):
        pip.append(["install", "-q", "--no-deps", nbkit_source])
    for args in pip:
        print("+ pip", *args)
        if not dry_run:
            subprocess.run([sys.executable, "-m", "pip", *args], check=True)
    if pip and not dry_run and "nbkit" in sys.modules:
        raise SystemExit("Restart the runtime (another nbkit was imported), then run all again.")
    importlib.invalidate_caches()
    from nbkit.setup import run_setup as run_colab_setup

    setup = run_colab_setup(["--from", nbkit_source, *setup_options])  # prints GPU, bf16/fp16, versions
    if setup.returncode != 0:
        raise RuntimeError("colab_setup.sh failed: its output above says why")
    if setup.stale_imports():
        raise SystemExit(f"Restart the runtime (upgraded after import: {', '.join(setup.stale_imports())}), "
                         "then run all again.")
else:
    print("setup skipped: not on Colab or Kaggle (run_setup=True runs colab_setup.sh anyway)")

# %% [markdown]
# ## The model

# %%
import gc
import json
import math
from pathlib import Path

import torch

import nbkit
from nbkit import FastSFT, FastSFTConfig, load_model
from nbkit.demo.models import Recipe
from nbkit.loading import pick_compute_dtype
from nbkit.memory import fmt_bytes
from nbkit.notebook import (RunProbe, answer_loss, answers, demo_chat_dataset, exact_match, keep_trainable_fp32,
                            md_table, pick_model, to_prompt_completion)

out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
compute_dtype = pick_compute_dtype()
device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
print(f"nbkit {nbkit.__version__}, torch {torch.__version__}, {gpu}, compute dtype {compute_dtype}")

choice = pick_model(model_name, gpu_default="Qwen/Qwen3-1.7B", tiny_family="qwen3", folder=out / "tiny-base",
                    seed=seed)
recipe = choice.recipe(Recipe(max_steps=60, learning_rate=2e-4, batch_size=4, max_length=512),
                       max_steps=max_steps, learning_rate=learning_rate, batch_size=batch_size,
                       max_length=max_length)
print("model:", choice.describe())
print(f"training: {recipe.max_steps} steps of {recipe.batch_size} rows x {recipe.max_length} tokens, "
      f"learning rate {recipe.learning_rate:g}")
results = {"model": choice.path, "tiny": choice.tiny, "load_in_4bit": load_in_4bit,
           "compute_dtype": str(compute_dtype).replace("torch.", ""), "max_steps": recipe.max_steps,
           "batch_size": recipe.batch_size, "max_length": recipe.max_length,
           "learning_rate": recipe.learning_rate}

# %%
torch.manual_seed(seed)  # LoRA's initial A matrices
model, tokenizer = load_model(
    choice.path,
    load_in_4bit=load_in_4bit,
    lora_r=lora_r,
    # the tiny recipe trains embeddings and head in full: a random-init model has none for LoRA to steer
    modules_to_save=list(recipe.modules_to_save) or None,
)
model.print_trainable_parameters()

# %% [markdown]
# ## The data, in the model's chat template
#
# Rows are conversations. nbkit's notebooks use TRL's *conversational prompt-completion* format (`prompt`: the
# turns before the answer, `completion`: the assistant's answer), so the loss covers the answer only, whatever the
# chat template. The cell prints one example as the model will read it.

# %%
from nbkit import load_jsonl  # datasets' JSON reader, after a line-by-line check that names a bad line
from nbkit.demo.data import demo_pairs

if own_data:
    train_dataset = to_prompt_completion(load_jsonl(own_data))
else:
    train_dataset = demo_chat_dataset(train_examples, split="train", seed=seed)
print(train_dataset)
example = train_dataset[0]
print("prompt:    ", example["prompt"])
print("completion:", example["completion"])
print("--- what the model reads (its chat template) ---")
print(tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=False))

# %% [markdown]
# ### Your own data
#
# One JSON object per line with a `messages` list of `{"role", "content"}` turns (system, user, assistant); the
# last turn is the answer to learn (rows with `prompt` and `completion` are taken as they are). The cell writes
# two such rows and loads them exactly as `own_data` would be, with `nbkit.load_jsonl`: an empty file or a line
# that is not a JSON object is named by its line number.
# Other column names? Map them to `messages` first, e.g. for `instruction` / `output` columns:
#
# ```python
# ds = ds.map(lambda r: {"messages": [{"role": "user", "content": r["instruction"]},
#                                     {"role": "assistant", "content": r["output"]}]})
# ```
#
# **Your file on Colab.** Upload it: the folder icon on the left, then the upload icon; it lands in `/content`, so
# `own_data = "/content/my_chats.jsonl"`. (In a cell: `from google.colab import files; files.upload()`.) An
# uploaded file is gone when the runtime is recycled; to keep it, put it in Google Drive and mount Drive:
#
# ```python
# from google.colab import drive
# drive.mount("/content/drive")  # asks for permission once
# own_data = "/content/drive/MyDrive/my_chats.jsonl"
# ```
#
# On Kaggle: *Add Input > Upload* a dataset, then `own_data = "/kaggle/input/<its name>/my_chats.jsonl"`. Set
# `own_data` in the parameters cell and run all again. The held-out scores below stay those of the demo's task:
# judge your own data by chatting with the model after training.

# %%
my_file = out / "my_chats.jsonl"
rows = [
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris"}]},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What colour is the sky on a clear day?"},
                  {"role": "assistant", "content": "Blue"}]},
]
my_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
mine = to_prompt_completion(load_jsonl(my_file))
print(mine)
print(tokenizer.apply_chat_template(mine[0]["prompt"] + mine[0]["completion"], tokenize=False))

# %% [markdown]
# ## Before training: answers on held-out prompts
#
# The model is scored on prompts it never trains on, with two numbers:
#
# - **exact match**: the share of them answered exactly right (greedy decoding, the answer compared as text);
# - **answer loss**: the mean cross-entropy per token of the expected answers, the tokens training's loss covers
#   (the prompt is not counted). Lower is better; 0 would be certainty. `exp(-loss)` is the probability the model
#   gives a right answer token, on average (geometric mean): printed beside it as "token probability".

# %%
eval_pairs = demo_pairs(eval_examples, split="eval", seed=seed)
questions = [q for q, _ in eval_pairs]
references = [a for _, a in eval_pairs]
before = answers(model, tokenizer, questions)
results["loss_before"] = answer_loss(model, tokenizer, eval_pairs)
results["exact_match_before"] = exact_match(before, references)
print(f"before training, on {len(eval_pairs)} held-out prompts: exact match {results['exact_match_before']:.0%}, "
      f"answer loss {results['loss_before']:.3f} (token probability {math.exp(-results['loss_before']):.1%})")

# %% [markdown]
# ## Train with FastSFT and the live dashboard
#
# `FastSFT` takes `SFTTrainer`'s arguments. In a notebook it shows `nbkit.LiveDashboard` by itself (one panel
# updated in place: progress, tokens/s, loss, learning rate, VRAM, RAM), which becomes a static summary at the end.

# %%
config = FastSFTConfig(
    output_dir=str(out / "trainer"),
    max_steps=recipe.max_steps,
    per_device_train_batch_size=recipe.batch_size,
    learning_rate=recipe.learning_rate,
    lr_scheduler_type="cosine",
    warmup_steps=max(1, recipe.max_steps // 20),
    weight_decay=0.0,
    packing=True,
    max_length=recipe.max_length,
    gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False},
    bf16=compute_dtype == torch.bfloat16,
    fp16=compute_dtype == torch.float16,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=seed,
    live_dashboard="auto",  # on in a notebook
)
trainer = FastSFT(model=model, args=config, train_dataset=train_dataset, processing_class=tokenizer)
keep_trainable_fp32(trainer)
probe = RunProbe()
trainer.add_callback(probe)
train_output = trainer.train()  # TRL's summary (steps, runtime, mean loss): the dashboard above shows it

# %%
from nbkit.dashboard import LiveDashboard

dashboard = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LiveDashboard)), None)
summary = dashboard.summary if dashboard is not None else None
results.update(
    steps=trainer.state.global_step,
    loss_first=probe.losses[0],
    loss_last=probe.losses[-1],
    tokens=probe.tokens,
    tokens_per_second=probe.tokens_per_second,
    peak_vram=probe.peak_memory,
    nbkit_attached=trainer.nbkit_attached,
    dashboard_mode=dashboard.active_mode if dashboard is not None else None,
    dashboard_tokens_per_second_mean=summary.tokens_per_s_mean if summary is not None else None,
)
md_table(["", ""], [
    ["steps", results["steps"]],
    ["training loss (first -> last step)", f"{results['loss_first']:.3f} -> {results['loss_last']:.3f}"],
    ["tokens/s (after the first step)", f"{results['tokens_per_second']:,.0f}"],
    ["peak VRAM", fmt_bytes(results["peak_vram"])],
    ["nbkit speedups used", ", ".join(results["nbkit_attached"]) or "none"],
])

# %% [markdown]
# ## After training: the same prompts

# %%
after = answers(model, tokenizer, questions)
results["exact_match_after"] = exact_match(after, references)
results["answers_after"] = after
results["loss_trained"] = answer_loss(model, tokenizer, eval_pairs)
print(f"on {len(eval_pairs)} held-out prompts, before -> after training: exact match "
      f"{results['exact_match_before']:.0%} -> {results['exact_match_after']:.0%}; answer loss "
      f"{results['loss_before']:.3f} -> {results['loss_trained']:.3f} (token probability "
      f"{math.exp(-results['loss_before']):.1%} -> {math.exp(-results['loss_trained']):.1%})")
md_table(["question", "expected", "before", "after"],
         [[q, r, b, a] for q, r, b, a in list(zip(questions, references, before, after))[:8]])

# %% [markdown]
# ## Chat with it
#
# `nbkit.chat.chat` applies the chat template, streams the answer as it is generated and stops at the template's
# end-of-turn token. On a GPU with room for it, it decodes from a dense copy of the model (4-bit weights dequantized,
# LoRA merged), one CUDA graph a step, ~20x `generate`'s speed; a token can differ from `generate`'s only where two
# logits tie within rounding (`chat(..., exact=True)` gives `generate`'s tokens exactly, more slowly).

# %%
from nbkit.chat import chat

question = questions[0]
print("Q:", question)
print("A: ", end="")
results["chat_reply"] = chat(model, tokenizer, question, max_new_tokens=32)

# %% [markdown]
# ## Save the adapter, reload it, check it

# %%
adapter_dir = out / "adapter"
trainer.save_model(str(adapter_dir))  # the LoRA weights (and tokenizer), not the base model
results["adapter_files"] = sorted(p.name for p in adapter_dir.iterdir())
print(adapter_dir, results["adapter_files"])

# %%
# Reload as you would for inference: the same (4-bit) base, then the adapter on top. Same model, same numbers.
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from nbkit.compat import quiet_peft_wrap
from nbkit.loading import keep_4bit_trainable

quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype) if load_in_4bit else None
base = AutoModelForCausalLM.from_pretrained(choice.path, quantization_config=quantization, dtype=compute_dtype,
                                            device_map=device_map)
# on a CPU, compare with the kernels the trained model used (bitsandbytes' CPU inference layout rounds in bf16)
keep_4bit_trainable(base)
with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated: its FutureWarning, not yours
    reloaded = PeftModel.from_pretrained(base, str(adapter_dir))
results["loss_reloaded"] = answer_loss(reloaded, tokenizer, eval_pairs)
tolerance = 1e-4 if compute_dtype == torch.float32 else 1e-2
gap = abs(results["loss_reloaded"] - results["loss_trained"]) / results["loss_trained"]
print(f"answer loss: trained {results['loss_trained']:.5f}, reloaded adapter {results['loss_reloaded']:.5f} "
      f"(relative gap {gap:.1e}, tolerance {tolerance:.0e})")
assert gap <= tolerance, "the reloaded adapter is not the trained one"
del reloaded, base

# %% [markdown]
# ## Merge into a 16-bit model
#
# Merging into the 4-bit base would round the result back to 4 bits. Instead the base is loaded in 16-bit and the
# adapter added to it, giving a standalone checkpoint any transformers (or vLLM, llama.cpp converter...) user can
# load. It differs from the 4-bit model you trained by the base's quantization error, so the check is that it
# keeps what training taught it.

# %%
from nbkit.export import save_merged

merge_dtype = torch.float16 if compute_dtype == torch.float16 else torch.bfloat16
gc.collect()
if torch.cuda.is_available():
    torch.cuda.empty_cache()
merged_dir = out / "merged-16bit"
# reloads the base in 16-bit, merges the adapter into it, saves, and checks the merged logits against the adapter's
merge_report = save_merged(model, tokenizer, merged_dir, check_prompts=questions[:4])
results["merge"] = merge_report.as_dict()
print(merged_dir, sorted(p.name for p in merged_dir.iterdir()))

# %%
merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=merge_dtype, device_map=device_map)
merged_tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
results["merged_dtype"] = str(merged.dtype).replace("torch.", "")
results["loss_merged"] = answer_loss(merged, merged_tokenizer, eval_pairs)
merged_answers = answers(merged, merged_tokenizer, questions)
results["exact_match_merged"] = exact_match(merged_answers, references)
results["merged_agrees_with_adapter"] = exact_match(merged_answers, after)
print(f"merged {results['merged_dtype']} model: answer loss {results['loss_merged']:.3f} "
      f"(before training {results['loss_before']:.3f}, trained 4-bit {results['loss_trained']:.3f}); "
      f"exact match {results['exact_match_merged']:.0%}; same answer as the adapter on "
      f"{results['merged_agrees_with_adapter']:.0%} of prompts")
assert results["loss_merged"] < results["loss_before"], "the merged model lost what training taught it"

# %% [markdown]
# ## Export GGUF for llama.cpp and Ollama
#
# Written in pure Python with the `gguf` package (llama.cpp's own writer): no llama.cpp build, no download. The file
# is read back with transformers' GGUF reader and its logits compared with the merged model's; an Ollama
# `Modelfile` (template and stop tokens) is written beside it: `ollama create my-model -f Modelfile`.

# %%
from nbkit.export import export_gguf

gguf_report = export_gguf(merged_dir, out / "gguf" / f"model-{gguf_quant}.gguf", quant=gguf_quant)
results["gguf"] = gguf_report.as_dict()
print(gguf_report.path, f"({gguf_report.path.stat().st_size / 2**20:.1f} MiB)")
print(gguf_report.modelfile.read_text())

# %%
# Reload the GGUF file (transformers' reader) and ask the same question. The reader rebuilds a config from the
# file but skips a few values llama.cpp reads (e.g. Qwen3's head size), so the merged folder's config is passed.
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

folder, name = str(gguf_report.path.parent), gguf_report.path.name
gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                  config=AutoConfig.from_pretrained(str(merged_dir)))
gguf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
if not getattr(gguf_tokenizer, "chat_template", None):
    gguf_tokenizer.chat_template = tokenizer.chat_template
print("Q:", question)
print("A: ", end="")
results["gguf_reply"] = chat(gguf_model, gguf_tokenizer, question, max_new_tokens=32)
del gguf_model

# %% [markdown]
# ## Summary

# %%
(out / "results.json").write_text(json.dumps(results, indent=2))
md_table(["", ""], [
    ["model", choice.describe()],
    ["training loss (first -> last step)", f"{results['loss_first']:.3f} -> {results['loss_last']:.3f}"],
    ["tokens/s", f"{results['tokens_per_second']:,.0f}"],
    ["peak VRAM", fmt_bytes(results["peak_vram"])],
    ["exact match (held-out prompts)", f"{results['exact_match_before']:.0%} -> {results['exact_match_after']:.0%} "
                                       f"(merged: {results['exact_match_merged']:.0%})"],
    ["answer loss (held-out answers)", f"{results['loss_before']:.3f} -> {results['loss_trained']:.3f}"],
    ["adapter", str(adapter_dir)],
    ["merged 16-bit model", str(merged_dir)],
    ["GGUF", f"{gguf_report.path} ({gguf_quant})"],
    ["all numbers", str(out / "results.json")],
])
