# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/nbkit/nbkit/blob/main/notebooks/04_moe_finetune.ipynb)
#
# # Fine-tune a mixture-of-experts model
#
# QLoRA on an MoE model: Qwen3-30B-A3B (128 experts, 8 per token) or gpt-oss-20b on a GPU, a tiny
# `qwen3_moe` (4 experts, 2 per token) on a CPU. PEFT's `all-linear` LoRA reaches the attention projections, the
# router and the fused expert weights; `FastSFTConfig(fast_moe_routing=True)` (the default) runs the experts through
# nbkit's routing (one sort by expert, contiguous slices or one grouped matmul, LoRA on experts as low-rank
# products). The notebook trains with it, checks the result, then trains again with it off to compare speed and loss.
#
# Memory: bitsandbytes quantizes linear layers only; fused 3-D expert weights stay in 16-bit. Qwen3-30B-A3B then
# needs about 65 GB of GPU memory (an 80 GB A100/H100 or an H200), gpt-oss-20b about 45 GB. For gpt-oss-20b set
# `load_in_4bit=False`: its experts ship in MXFP4, which transformers dequantizes to bf16 for training.

# %% [markdown]
# **Run it on Colab**: pick a GPU first: *Runtime > Change runtime type > H100 GPU* (Colab Pro: Qwen3-30B-A3B needs
# about 65 GB of GPU memory) and *Save*; then *Runtime > Run all*. The setup cell installs nbkit; if it asks for a restart,
# *Runtime > Restart session* and run all again. With `model_name="auto"` the notebook trains Qwen3-30B-A3B on a
# GPU with room for it; on a smaller one (a T4) it says so and trains the tiny model instead. On a CPU runtime
# (Colab's default) it also runs to the end on a tiny randomly initialised `qwen3_moe` saved to a local folder with
# nbkit's demo tokenizer (the model cell says which it took): that shows every step working, not what fine-tuning
# teaches a real model; about four minutes on two cores. Both go through the same `nbkit.load_model(path)` call.
# The first code cell holds the parameters (tagged `parameters`, so papermill or nbclient can override them).

# %% tags=["parameters"]
# Parameters
model_name = "auto"  # "auto": Qwen/Qwen3-30B-A3B on a GPU with 70 GiB, else a tiny local MoE; "openai/gpt-oss-20b"
min_gpu_gib = 70  # "auto" takes the real model on a GPU with at least this much memory
tiny_family = "qwen3_moe"  # the tiny model's architecture: qwen3_moe, mixtral or gpt_oss
load_in_4bit = True
lora_r = 16
max_steps = 60
max_length = 1024
batch_size = 2
learning_rate = None  # None: 1e-4 for a pretrained model, 3e-3 for the tiny random-init one
train_examples = 2000
eval_examples = 16
compare_plain_routing = True  # train again with fast_moe_routing=False (a second load) to compare
gguf_quant = "q8_0"  # GGUF type for the export at the end (nbkit.export.QUANT_TYPES)
export_to_gguf = "auto"  # "auto": the tiny model only (merging and checking hold float32 copies); True; False
output_dir = "nbkit-out/04_moe_finetune"  # everything this notebook writes goes here
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
# ## Is nbkit's MoE routing there?

# %%
import gc
import json
from pathlib import Path

import torch

import nbkit
from nbkit import FastSFT, FastSFTConfig, load_model
from nbkit.demo.data import demo_pairs
from nbkit.loading import pick_compute_dtype
from nbkit.memory import device_memory, fmt_bytes
from nbkit.notebook import (RunProbe, answers, demo_chat_dataset, exact_match, feature, keep_trainable_fp32,
                            md_table, pick_model, answer_loss)

missing = []
ok, message = feature("nbkit.speedups.moe", "FastMoERouting")
if not ok:
    missing.append(message)
if "fast_moe_routing" not in FastSFTConfig.__dataclass_fields__:
    missing.append("FastSFTConfig has no fast_moe_routing switch")
routing_available = not missing
if routing_available:
    print("fast MoE routing: available (nbkit.speedups.moe.FastMoERouting, FastSFTConfig.fast_moe_routing)")
else:
    print("nbkit's MoE routing is NOT available in this nbkit: the model trains on transformers' experts path. "
          "Missing:")
    for item in missing:
        print("  -", item)

# %% [markdown]
# ## The model

# %%
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
compute_dtype = pick_compute_dtype()
device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
gpu_bytes = device_memory().total if torch.cuda.is_available() else None
name = model_name
if model_name == "auto" and gpu_bytes is not None and gpu_bytes < min_gpu_gib * 2**30:
    print(f"{gpu} has {fmt_bytes(gpu_bytes)}: too little for Qwen3-30B-A3B (about 65 GB), so the tiny model trains "
          "instead. On a GPU of 48 GB or more: model_name='openai/gpt-oss-20b', load_in_4bit=False (about 45 GB).")
    name = "tiny"
choice = pick_model(name, gpu_default="Qwen/Qwen3-30B-A3B", tiny_family=tiny_family, folder=out / "tiny-base",
                    seed=seed)
lr = learning_rate if learning_rate is not None else (3e-3 if choice.tiny else 1e-4)
print(f"nbkit {nbkit.__version__}, torch {torch.__version__}, {gpu}, compute dtype {compute_dtype}")
print("model:", choice.describe())


def load():
    torch.manual_seed(seed)
    return load_model(choice.path, load_in_4bit=load_in_4bit, lora_r=lora_r,
                      modules_to_save=["embed_tokens", "lm_head"] if choice.tiny else None)


model, tokenizer = load()
model.print_trainable_parameters()
text_config = model.config.get_text_config()
experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
lora_on_experts = any(".experts." in name and "lora_" in name for name, _ in model.named_parameters())
print(f"{experts} experts, {text_config.num_experts_per_tok} per token; LoRA on expert weights: "
      f"{'yes' if lora_on_experts else 'no'}")
results = {"model": choice.path, "tiny": choice.tiny, "experts": experts, "routing_available": routing_available,
           "missing": missing, "lora_on_experts": lora_on_experts}

# %% [markdown]
# ## Data and answers before training
#
# The model is scored on prompts it never trains on: **exact match**, the share of them answered exactly right
# (greedy decoding), and **answer loss**, the mean cross-entropy per token of the expected answers (the tokens
# training's loss covers; the prompt is not counted): lower is better, 0 would be certainty.

# %%
train_dataset = demo_chat_dataset(train_examples, split="train", seed=seed)
eval_pairs = demo_pairs(eval_examples, split="eval", seed=seed)
questions = [q for q, _ in eval_pairs]
references = [a for _, a in eval_pairs]
before = answers(model, tokenizer, questions)
results["loss_before"] = answer_loss(model, tokenizer, eval_pairs)
results["exact_match_before"] = exact_match(before, references)
print(f"before training, on {len(eval_pairs)} held-out prompts: exact match {results['exact_match_before']:.0%}, "
      f"answer loss {results['loss_before']:.3f}")

# %% [markdown]
# ## Train with FastSFT (fast MoE routing on, where this nbkit has it)

# %%
def config(**switches):
    return FastSFTConfig(
        output_dir=str(out / "trainer"), max_steps=max_steps, per_device_train_batch_size=batch_size,
        learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0, packing=True, max_length=max_length,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=compute_dtype == torch.bfloat16, fp16=compute_dtype == torch.float16, logging_steps=1,
        save_strategy="no", report_to="none", seed=seed, **switches,
    )


trainer = FastSFT(model=model, args=config(fast_moe_routing=routing_available), train_dataset=train_dataset,
                  processing_class=tokenizer)
keep_trainable_fp32(trainer)
probe = RunProbe()
trainer.add_callback(probe)
trainer.train()
routing_used = any(name.startswith("fast_moe_routing") for name in trainer.nbkit_attached)
results.update(loss_first=probe.losses[0], loss_last=probe.losses[-1], losses=probe.losses,
               grad_norms=probe.grad_norms, tokens_per_second=probe.tokens_per_second, peak_vram=probe.peak_memory,
               nbkit_attached=trainer.nbkit_attached, routing_used=routing_used)
print("nbkit speedups used:", ", ".join(trainer.nbkit_attached) or "none")
if routing_available and not routing_used:
    print("NOTE: fast_moe_routing did not attach to this model; its log line above says why. The experts ran on "
          "transformers' path.")

# %% [markdown]
# ## After training

# %%
after = answers(model, tokenizer, questions)
results["exact_match_after"] = exact_match(after, references)
results["answers_after"] = after
results["loss_trained"] = answer_loss(model, tokenizer, eval_pairs)
print(f"on {len(eval_pairs)} held-out prompts: exact match {results['exact_match_before']:.0%} -> "
      f"{results['exact_match_after']:.0%}; answer loss {results['loss_before']:.3f} -> {results['loss_trained']:.3f}")
md_table(["question", "expected", "before", "after"],
         [[q, r, b, a] for q, r, b, a in list(zip(questions, references, before, after))[:6]])

# %% [markdown]
# ## Chat with it
#
# `nbkit.chat.chat` applies the chat template, streams the answer and stops at the template's end-of-turn token.

# %%
from nbkit.chat import chat

print("Q:", questions[0])
print("A: ", end="")
results["chat_reply"] = chat(model, tokenizer, questions[0], max_new_tokens=32)

# %% [markdown]
# ## Save the adapter, reload it, check it

# %%
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from nbkit.compat import quiet_peft_wrap
from nbkit.loading import keep_4bit_trainable

adapter_dir = out / "adapter"
trainer.save_model(str(adapter_dir))
results["adapter_files"] = sorted(p.name for p in adapter_dir.iterdir())
quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype) if load_in_4bit else None
del trainer, model
gc.collect()
if torch.cuda.is_available():
    torch.cuda.empty_cache()
base = AutoModelForCausalLM.from_pretrained(choice.path, quantization_config=quantization, dtype=compute_dtype,
                                            device_map=device_map)
# on a CPU, compare with the kernels the trained model used (bitsandbytes' CPU inference layout rounds in bf16)
keep_4bit_trainable(base)
with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated: its FutureWarning, not yours
    reloaded = PeftModel.from_pretrained(base, str(adapter_dir))
results["loss_reloaded"] = answer_loss(reloaded, tokenizer, eval_pairs)
tolerance = 1e-4 if compute_dtype == torch.float32 else 1e-2
gap = abs(results["loss_reloaded"] - results["loss_trained"]) / results["loss_trained"]
print(f"adapter saved to {adapter_dir}; reloaded: answer loss {results['loss_reloaded']:.5f} vs trained "
      f"{results['loss_trained']:.5f} (relative gap {gap:.1e}, tolerance {tolerance:.0e})")
assert gap <= tolerance, "the reloaded adapter is not the trained one"
del reloaded, base
gc.collect()
if torch.cuda.is_available():
    torch.cuda.empty_cache()

# %% [markdown]
# ## The same run with fast MoE routing off
#
# Both runs start from the same weights and see the same batches, so at step 1 the two experts paths must give the
# same loss and gradient norm, up to the rounding of sums taken in another order: that is the check (1e-4 relative
# in fp32, 2e-2 in bf16/fp16, as in `03_long_context`). From step 2 on, each path's rounding has changed its
# weights a little, and training carries that forward step after step, most where the loss falls fastest: the
# curves stay close but part slowly, by more the longer the run, as any two runs whose sums round differently do.
# Their largest gap is printed beside the check, not held to the first step's tolerance.

# %%
if compare_plain_routing and routing_available:
    model, tokenizer = load()
    trainer = FastSFT(model=model, args=config(fast_moe_routing=False), train_dataset=train_dataset,
                      processing_class=tokenizer)
    keep_trainable_fp32(trainer)
    plain_probe = RunProbe()
    trainer.add_callback(plain_probe)
    trainer.train()
    first_gap = max(abs(ours[0] - theirs[0]) / abs(theirs[0]) for ours, theirs in
                    ((results["losses"], plain_probe.losses), (results["grad_norms"], plain_probe.grad_norms)))
    first_tolerance = 1e-4 if compute_dtype == torch.float32 else 2e-2
    gaps = [abs(a - b) / abs(b) for a, b in zip(results["losses"], plain_probe.losses)]
    results.update(plain_tokens_per_second=plain_probe.tokens_per_second, plain_peak_vram=plain_probe.peak_memory,
                   plain_losses=plain_probe.losses, first_step_gap=first_gap, first_step_tolerance=first_tolerance,
                   max_relative_loss_gap=max(gaps))
    print(f"step 1 (same weights, same batch): same loss and gradient norm within {first_tolerance:.0e} relative: "
          f"{first_gap <= first_tolerance} (gap {first_gap:.1e})")
    print(f"over {len(gaps)} steps, with each path's rounding carried forward: largest loss gap {max(gaps):.1e}, "
          f"final loss {results['loss_last']:.4f} against {plain_probe.losses[-1]:.4f}")
    del trainer, model
    gc.collect()
    display(md_table(["experts path", "tokens/s", "peak VRAM", "final loss"], [
        ["nbkit fast_moe_routing" if routing_used else "transformers (routing did not attach)",
         f"{results['tokens_per_second']:,.0f}", fmt_bytes(results["peak_vram"]), f"{results['loss_last']:.4f}"],
        ["transformers (fast_moe_routing=False)", f"{plain_probe.tokens_per_second:,.0f}",
         fmt_bytes(plain_probe.peak_memory), f"{plain_probe.losses[-1]:.4f}"],
    ]))
elif not routing_available:
    print("skipped: there is no nbkit MoE routing to compare with (see the check at the top)")
else:
    print("skipped (compare_plain_routing=False)")
results_file = out / "results.json"
results_file.write_text(json.dumps(results, indent=2))
print("numbers so far:", results_file)

# %% [markdown]
# ## Merge and export GGUF for llama.cpp and Ollama
#
# The adapter is merged into the original 16-bit base (checked by logits against the adapter model), then written
# as one GGUF file: each layer's experts stacked as llama.cpp reads them (`ffn_gate_exps`, `ffn_up_exps`,
# `ffn_down_exps`), the router kept in float32, an Ollama `Modelfile` beside it. The file is read back and its
# logits compared with the merged model's: by transformers' GGUF reader for Qwen3-MoE, by nbkit's own reader for
# Mixtral (transformers reads no llama with experts). gpt-oss is not exported; the message says what llama.cpp's
# format needs.

# %%
from nbkit.export import export_gguf, merge_folder

if export_to_gguf is True or (export_to_gguf == "auto" and choice.tiny):
    gc.collect()
    merged_dir = out / "merged-16bit"
    merge_report = merge_folder(adapter_dir, merged_dir, check_prompts=questions[:4], tokenizer=tokenizer)
    results["merge"] = merge_report.as_dict()
    try:
        gguf_report = export_gguf(merged_dir, out / "gguf" / f"model-{gguf_quant}.gguf", quant=gguf_quant,
                                  check_prompts=questions[:4])
    except NotImplementedError as refused:  # gpt-oss: the message names what is missing
        results["gguf"] = {"refused": str(refused)}
        print("no GGUF file:", refused)
    else:
        results["gguf"] = gguf_report.as_dict()
        print(gguf_report.path, f"({gguf_report.path.stat().st_size / 2**20:.1f} MiB)")
        print(gguf_report.modelfile.read_text())
else:
    print("GGUF export skipped (export_to_gguf=True to merge and export this model)")
results_file.write_text(json.dumps(results, indent=2))
print("all numbers:", results_file)
