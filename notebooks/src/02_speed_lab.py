# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/nbkit/nbkit/blob/main/notebooks/02_speed_lab.ipynb)
#
# # Speed lab: every nbkit switch on and off, next to plain TRL
#
# The same short run (same model, data, seed and hyper-parameters) with TRL's plain `SFTTrainer`, with
# `nbkit.FastSFT` as it comes, and with `FastSFT` with one switch of `FastSFTConfig` flipped at a time. For each:
# tokens/s (TRL's token count, first step left out) and peak VRAM as bars, and the loss curves overlaid. The
# switches change speed and memory only, so every run's first step gives plain TRL's loss and gradient norm (up to
# rounding), and the curves stay close after it.
#
# On a CPU the tiny model's numbers measure Python and framework overhead, not GPU kernels: read the speed bars on
# a GPU. The loss overlay means the same everywhere.

# %% [markdown]
# **Run it on Colab**: pick a GPU first: *Runtime > Change runtime type > T4 GPU* (the free one) and *Save*; then
# *Runtime > Run all*. The setup cell installs nbkit; if it asks for a restart, *Runtime > Restart session* and run
# all again. With `model_name="auto"` the notebook trains Qwen/Qwen3-1.7B on the GPU. On a CPU runtime (Colab's
# default) it still runs to the end, on a tiny randomly initialised model of the same architecture saved to a local
# folder with nbkit's demo tokenizer (the first cell after setup says which it took): 7 to 20 minutes on two cores
# (every variant trains 30 steps; a smaller `max_steps` gives a quicker look), and its speed bars then measure
# Python overhead, not GPU kernels. Both go through the same `nbkit.load_model(path)` call. The first code cell
# holds the parameters (tagged `parameters`, so papermill or nbclient can override them).

# %% tags=["parameters"]
# Parameters
model_name = "auto"  # "auto": Qwen/Qwen3-1.7B on a GPU, a tiny local qwen3 without one; "tiny"; a Hub id; a folder
load_in_4bit = True
lora_r = 16
max_steps = 30
max_length = 1024
batch_size = 4
learning_rate = None  # None: 2e-4 for a pretrained model, 3e-3 for the tiny random-init one
train_examples = 4000
variants = None  # None: all that apply; or a list of names from the table printed below
output_dir = "nbkit-out/02_speed_lab"  # everything this notebook writes goes here
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

# %%
import gc
import json
import math
from pathlib import Path

import torch

import nbkit  # before TRL: importing nbkit first keeps a bitsandbytes hint about Hub kernels out of the output
from nbkit import FastSFT, FastSFTConfig, load_model
from nbkit.compat import checkpointing_args
from nbkit.dashboard import attach_dashboard
from nbkit.loading import pick_compute_dtype
from nbkit.memory import fmt_bytes
from nbkit.notebook import RunProbe, demo_chat_dataset, keep_trainable_fp32, md_table, pick_model
from transformers import AutoConfig
from trl import SFTConfig, SFTTrainer

out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
compute_dtype = pick_compute_dtype()
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
choice = pick_model(model_name, gpu_default="Qwen/Qwen3-1.7B", tiny_family="qwen3", folder=out / "tiny-base",
                    seed=seed)
lr = learning_rate if learning_rate is not None else (3e-3 if choice.tiny else 2e-4)
model_config = AutoConfig.from_pretrained(choice.path)
is_moe = any(getattr(model_config.get_text_config(), key, None) for key in ("num_experts", "num_local_experts"))
print(f"nbkit {nbkit.__version__}, torch {torch.__version__}, {gpu}, compute dtype {compute_dtype}")
print("model:", choice.describe(), "(MoE)" if is_moe else "(dense)")

# name -> FastSFTConfig overrides (None: TRL's plain SFTTrainer). One switch flipped from its default per row.
ALL_VARIANTS = {
    "SFTTrainer (plain TRL)": None,
    "FastSFT (defaults)": {},
    "cached_packing=False": {"cached_packing": False},
    "offload_checkpointing=True": {"offload_checkpointing": True},  # default "auto": on only where it pays
    "offload_double_buffer=False": {"offload_checkpointing": True, "offload_double_buffer": False},
    "cuda_graphs=False": {"cuda_graphs": False},  # default "auto": short rows on CUDA replay each layer as a graph
    "fast_moe_routing=False": {"fast_moe_routing": False},
    "live_dashboard=False": {"live_dashboard": False},
}
if not is_moe:
    del ALL_VARIANTS["fast_moe_routing=False"]  # nothing to route in a dense model
    print("fast_moe_routing is left out: this model has no experts (see 04_moe_finetune)")
chosen = variants if variants is not None else list(ALL_VARIANTS)
unknown = [name for name in chosen if name not in ALL_VARIANTS]
assert not unknown, f"unknown variants {unknown}; choose from {list(ALL_VARIANTS)}"
print("variants:", chosen)

# %%
train_dataset = demo_chat_dataset(train_examples, split="train", seed=seed)
common = dict(
    max_steps=max_steps,
    per_device_train_batch_size=batch_size,
    learning_rate=lr,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    packing=True,
    max_length=max_length,
    # gradient_checkpointing=True under this transformers' name (5.2x renamed it: TRL's SFTConfig warns on the old)
    **checkpointing_args(True, {"use_reentrant": False}),
    bf16=compute_dtype == torch.bfloat16,
    fp16=compute_dtype == torch.float16,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    dataloader_pin_memory=torch.cuda.is_available(),  # pinning needs a GPU to copy to (torch warns on a CPU)
    seed=seed,
)


def run_variant(name, overrides):
    """Load the model afresh (same seed: same LoRA init), train, measure, free."""
    torch.manual_seed(seed)
    model, tokenizer = load_model(choice.path, load_in_4bit=load_in_4bit, lora_r=lora_r, max_seq_length=max_length,
                                  modules_to_save=["embed_tokens", "lm_head"] if choice.tiny else None)
    output = str(out / "runs" / name.replace(" ", "_").replace("=", "-"))
    if overrides is None:
        trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=output, **common),
                             train_dataset=train_dataset, processing_class=tokenizer)
        attach_dashboard(trainer)  # the same panel FastSFT shows, so only the speedups differ
    else:
        trainer = FastSFT(model=model, args=FastSFTConfig(output_dir=output, **common, **overrides),
                          train_dataset=train_dataset, processing_class=tokenizer)
    keep_trainable_fp32(trainer)
    probe = RunProbe()
    trainer.add_callback(probe)
    trainer.train()
    row = {"name": name, "tokens_per_second": probe.tokens_per_second, "peak_vram": probe.peak_memory,
           "losses": probe.losses, "grad_norms": probe.grad_norms,
           "nbkit_attached": list(getattr(trainer, "nbkit_attached", []))}
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row

# %% [markdown]
# ## The runs

# %%
rows = []
for name in chosen:
    print(f"=== {name}")
    rows.append(run_variant(name, ALL_VARIANTS[name]))
    print(f"    {rows[-1]['tokens_per_second']:,.0f} tokens/s, peak VRAM {fmt_bytes(rows[-1]['peak_vram'])}, "
          f"nbkit: {', '.join(rows[-1]['nbkit_attached']) or '-'}")

# %% [markdown]
# ## Results
#
# Every run starts from the same weights and sees the same batches, so at step 1 each must give the reference's
# loss and gradient norm, up to the rounding of sums taken in another order: that is the check (1e-4 relative in
# fp32, 2e-2 in bf16/fp16, as in `03_long_context`). From step 2 on, each run's rounding has changed its weights a
# little and training carries that forward, so the curves part slowly, by more the longer the run: the largest gap
# over the whole run is in the table, not held to the first step's tolerance.

# %%
reference = rows[0]  # the first variant (plain TRL unless `variants` says otherwise)
tolerance = 1e-4 if compute_dtype == torch.float32 else 2e-2  # one step's sums in another order


def relative_gaps(row, key):
    return [abs(a - b) / abs(b) for a, b in zip(row[key], reference[key])]


for row in rows:
    row["first_step_gap"] = max(relative_gaps(row, "losses")[:1] + relative_gaps(row, "grad_norms")[:1],
                                default=math.nan)
    row["max_relative_loss_gap"] = max(relative_gaps(row, "losses"), default=math.nan)
    row["speedup"] = row["tokens_per_second"] / reference["tokens_per_second"]
same_first_step = all(row["first_step_gap"] <= tolerance for row in rows)
print(f"step 1 (same weights, same batch): every variant's loss and gradient norm match {reference['name']!r} "
      f"within {tolerance:.0e} relative: {same_first_step}")
widest = max(rows, key=lambda r: r["max_relative_loss_gap"])
print(f"over {len(reference['losses'])} steps, with each run's rounding carried forward: largest loss gap "
      f"{widest['max_relative_loss_gap']:.1e} ({widest['name']})")
summary = {"reference": reference["name"], "first_step_tolerance": tolerance, "same_first_step": same_first_step,
           "cuda": torch.cuda.is_available(), "model": choice.path, "rows": rows}
(out / "results.json").write_text(json.dumps(summary, indent=2))
md_table(["variant", "tokens/s", "vs reference", "peak VRAM", "final loss", "step-1 gap", "max loss gap",
          "nbkit speedups used"],
         [[r["name"], f"{r['tokens_per_second']:,.0f}", f"{r['speedup']:.2f}x", fmt_bytes(r["peak_vram"]),
           f"{r['losses'][-1]:.4f}", f"{r['first_step_gap']:.1e}", f"{r['max_relative_loss_gap']:.1e}",
           ", ".join(r["nbkit_attached"]) or "-"] for r in rows])

# %%
import matplotlib.pyplot as plt

names = [r["name"] for r in rows]
fig, (ax_speed, ax_mem, ax_loss) = plt.subplots(1, 3, figsize=(17, 4.8))
ax_speed.barh(names, [r["tokens_per_second"] for r in rows], color="#1f77b4")
ax_speed.set_xlabel("tokens/s (higher is better)")
ax_speed.invert_yaxis()
if all(r["peak_vram"] is not None for r in rows):
    ax_mem.barh(names, [r["peak_vram"] / 2**30 for r in rows], color="#ff7f0e")
    ax_mem.set_xlabel("peak VRAM, GiB (lower is better)")
    ax_mem.invert_yaxis()
else:
    ax_mem.set_axis_off()
    ax_mem.text(0.5, 0.5, "no CUDA GPU:\npeak VRAM not measured", ha="center", va="center", fontsize=12)
styles = ["-", "--", ":", "-."]
for i, r in enumerate(rows):
    width = 2.5 - 1.5 * i / max(1, len(rows) - 1)  # thinner on top, so that coinciding curves stay visible
    ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], styles[i % 4], lw=width, label=r["name"])
ax_loss.set_xlabel("step")
ax_loss.set_ylabel("training loss")
ax_loss.legend(fontsize=8)
ax_loss.set_title("loss curves (same at step 1, then part by rounding)")
model_label = f"tiny {choice.family} (random init)" if choice.tiny else choice.path
fig.suptitle(f"{model_label} | {gpu} | {max_steps} steps x {batch_size} rows x {max_length} tokens")
fig.tight_layout()
fig.savefig(out / "speed_lab.png", dpi=100)
plt.show()
