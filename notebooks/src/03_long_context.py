# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/nbkit/nbkit/blob/main/notebooks/03_long_context.ipynb)
#
# # Long context: the longest sequence that trains on this GPU, plain TRL against FastSFT
#
# How long a row fits decides whether you can fine-tune on long documents at all. This notebook finds, on your GPU
# and your model, the longest single sequence (batch 1, gradient checkpointing) that trains with TRL's plain
# `SFTTrainer` and with `FastSFT` on its defaults, and shows the table: longest fit, first out-of-memory, peak
# VRAM, host memory, step time and tokens/s, and whether both trainers give the same loss and gradient norm at the
# lengths where both fit. It is the method of nbkit's long-context benchmark (`python -m benchmarks.long_context`,
# BENCHMARKS.md, Long context), with your GPU as the budget.
#
# What FastSFT does for a long row, each a switch of `FastSFTConfig`: offloaded checkpointing (each layer's saved
# input waits in pinned host memory and is copied back, double-buffered, before its recompute), the MLP tiled over
# the sequence when a call would not fit (`tiled_mlp="auto"`), varlen attention (nothing of size L x L) and the loss
# without the L x vocabulary logits. The price of the offload is host memory, about `layers x hidden x 2` bytes per
# token: on a host with little RAM (free Colab has ~12 GB) cap it with
# `fastsft_switches = {"offload_max_host_bytes": 6 * 2**30}`; the inputs past the cap stay on the GPU.
#
# Running out of GPU memory is an error the search catches; running out of host memory is not (the kernel kills
# the process, and the notebook with it). So before each try the search predicts, from the tries at shorter
# lengths, the host memory and the time a step will take, and does not run a try that would exceed `host_fraction`
# of the available host memory or `max_step_seconds`; it says where it stopped and why. `memory_budget_gib` lets a
# large GPU stand in for a smaller card (PyTorch's per-process memory cap). On a CPU there is no VRAM to run out of:
# the search stops at host memory, time or its limit, and the CPU run shows that both paths run and agree.

# %% [markdown]
# **Run it on Colab**: pick a GPU first: *Runtime > Change runtime type > T4 GPU* (the free one) and *Save*; then
# *Runtime > Run all*. The setup cell installs nbkit; if it asks for a restart, *Runtime > Restart session* and run
# all again. With `model_name="auto"` the notebook searches with the real model on the GPU. On a CPU runtime
# (Colab's default) it still runs to the end, on a tiny randomly initialised model of the same architecture saved
# to a local folder with nbkit's demo tokenizer (the model cell says which it took): there is no VRAM to find the
# limit of, so it shows that both trainers run and agree; about two minutes on two cores. Both go through the same
# `nbkit.load_model(path)` call. The first code cell holds the parameters (tagged `parameters`, so papermill or
# nbclient can override them).

# %% tags=["parameters"]
# Parameters
model_name = "auto"  # "auto": Qwen/Qwen3-1.7B on a GPU, a tiny local qwen3 without one; "tiny"; a Hub id; a folder
load_in_4bit = True
lora_r = 16
paths = ["trl", "fastsft"]  # plain TRL SFTTrainer and FastSFT with its defaults (one of them is enough)
fastsft_switches = {}  # FastSFTConfig switches changed for FastSFT, e.g. {"offload_max_host_bytes": 6 * 2**30}
memory_budget_gib = None  # None: the whole GPU; a number: the GPU capped to it (emulates a smaller card)
start_length = None  # first length tried, doubled while it fits; None: 4096 on a GPU, 1024 on a CPU
max_try_length = 262144  # the search limit
refine_steps = 2  # bisections between the longest fit and the first length that does not fit
steps_per_try = 2  # the second step runs with the optimizer state allocated, as in a real run
max_step_seconds = None  # no try predicted to take longer a step; None: 300 on a GPU, 15 on a CPU
host_fraction = 0.8  # no try predicted to take more than this share of the available host memory
output_dir = "nbkit-out/03_long_context"  # everything this notebook writes goes here
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
# ## What FastSFT has here

# %%
import gc
import json
from pathlib import Path

import torch

import nbkit
from nbkit import FastSFT, FastSFTConfig, load_model
from nbkit.loading import pick_compute_dtype
from nbkit.memory import fmt_bytes
from nbkit.compat import checkpointing_args
from nbkit.notebook import LengthSearch, RunProbe, feature, keep_trainable_fp32, md_table, pick_model
from nbkit.ops.offload_lanes import release_host_cache

unknown = [p for p in paths if p not in ("trl", "fastsft")]
if unknown or not paths:
    raise ValueError(f"paths: {paths!r}; the paths are 'trl' and 'fastsft'")
missing = []
switches = dict(fastsft_switches)
ok, message = feature("nbkit.speedups.offload", "OffloadedCheckpointing")
if not ok:
    missing.append(message)
    switches["offload_checkpointing"] = False  # FastSFT runs with what it has
offload_available = not missing
bad = sorted(set(switches) - set(FastSFTConfig.__dataclass_fields__))
if bad:
    raise ValueError(f"fastsft_switches: {bad} are not FastSFTConfig fields")
if offload_available:
    print("offloaded checkpointing: available (FastSFTConfig.offload_checkpointing, default 'auto': on CUDA GPUs "
          "for layer inputs of 16 MiB or more)")
else:
    print("offloaded checkpointing is NOT available in this nbkit, so FastSFT runs without it. Missing:")
    for item in missing:
        print("  -", item)
if switches:
    print("FastSFT's switches changed here:", switches)

# %%
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
compute_dtype = pick_compute_dtype()
cuda = torch.cuda.is_available()
gpu = torch.cuda.get_device_name() if cuda else "no CUDA GPU"
budget = None
if cuda:
    total = torch.cuda.get_device_properties(0).total_memory
    if memory_budget_gib is not None:
        budget = min(int(memory_budget_gib * 2**30), total)
    torch.cuda.set_per_process_memory_fraction(budget / total if budget else 1.0)  # a rerun lifts an old cap
    print(f"GPU memory: {fmt_bytes(budget or total)}" + (f" (capped, of {fmt_bytes(total)})" if budget else ""))
elif memory_budget_gib is not None:
    print("memory_budget_gib is ignored without a CUDA GPU")
choice = pick_model(model_name, gpu_default="Qwen/Qwen3-1.7B", tiny_family="qwen3", folder=out / "tiny-base",
                    seed=seed)
print(f"nbkit {nbkit.__version__}, torch {torch.__version__}, {gpu}, compute dtype {compute_dtype}")
print("model:", choice.describe())
first_length = start_length or (4096 if cuda else 1024)
step_limit = max_step_seconds or (300 if cuda else 15)
torch.manual_seed(seed)
model, tokenizer = load_model(choice.path, load_in_4bit=load_in_4bit, lora_r=lora_r, gradient_checkpointing=True)
text_config = model.config.get_text_config()
layers, hidden, vocab = text_config.num_hidden_layers, text_config.hidden_size, text_config.vocab_size

# %% [markdown]
# ### What a token costs
#
# Arithmetic, not a measurement: the checkpointed layer inputs are what offloading moves to host memory; the
# logits (in fp32 inside a plain loss, and their gradient) are what a loss without full logits never builds.

# %%
element = torch.tensor([], dtype=compute_dtype).element_size()
per_token_checkpoints = layers * hidden * element
per_token_logits = vocab * (element + 4 + 4)  # logits, their fp32 copy in the loss, its gradient
md_table(["per token", "bytes", "at 32k tokens"], [
    [f"checkpointed layer inputs ({layers} layers x {hidden} x {element} B)", f"{per_token_checkpoints:,}",
     fmt_bytes(per_token_checkpoints * 32768)],
    [f"full logits and their gradient ({vocab:,} vocabulary)", f"{per_token_logits:,}",
     fmt_bytes(per_token_logits * 32768)],
])

# %% [markdown]
# ## One training step per length

# %%
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from nbkit.demo.data import make_dataset

texts = make_dataset("text", n=4000, split="train", seed=seed)["text"]
# each document ends with the eos token, as in pretraining data: the model sees where one ends (and the trainer's
# stop-token check finds the token it needs to learn)
stream = [token for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]
          for token in ids + [tokenizer.eos_token_id]]
print(f"token stream: {len(stream):,} tokens, repeated as needed")


def tokens(length):
    return (stream * (length // len(stream) + 1))[:length]


def try_length(length, path):
    """Train `steps_per_try` steps on one sequence of `length` tokens with `path`'s trainer. Learning rate 0:
    every try starts from the same weights, so the two trainers' losses and gradient norms can be compared."""
    common = dict(
        output_dir=str(out / "trainer"), max_steps=steps_per_try, per_device_train_batch_size=1,
        learning_rate=0.0, max_length=length, packing=False, bf16=compute_dtype == torch.bfloat16,
        fp16=compute_dtype == torch.float16, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=seed,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinning needs a GPU to copy to (torch warns on a CPU)
        # gradient_checkpointing=True under this transformers' name (5.2x renamed it: SFTConfig warns on the old)
        **checkpointing_args(True, {"use_reentrant": False}),
    )
    if path == "fastsft":
        config, trainer_cls = FastSFTConfig(**common, live_dashboard=False, **switches), FastSFT
    else:
        config, trainer_cls = SFTConfig(**common), SFTTrainer
    trainer = trainer_cls(model=model, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"input_ids": [tokens(length)]}))
    trainer.remove_callback(PrinterCallback)
    keep_trainable_fp32(trainer)
    probe = RunProbe()
    trainer.add_callback(probe)
    try:
        trainer.train()
        row = {"fits": True, "peak_vram": probe.peak_memory, "loss": probe.losses[-1],
               "grad_norm": probe.grad_norms[-1], "seconds_per_step": probe.seconds_per_step,
               "tokens_per_second": length / probe.seconds_per_step,
               "nbkit_attached": list(getattr(trainer, "nbkit_attached", []))}
    except torch.OutOfMemoryError as error:  # FastSFT's TrainingOutOfMemoryError is one
        row = {"fits": False, "error": str(error).strip().splitlines()[0][:300]}
    except RuntimeError as error:  # a host allocation refused (where the kernel refuses rather than kills)
        if "can't allocate memory" not in str(error):
            raise
        row = {"fits": False, "error": str(error).strip().splitlines()[0][:300]}
    del trainer
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    release_host_cache()  # pinned host blocks torch caches for nobody, between tries
    return row


def search(path):
    """Double from first_length while it fits, then bisect towards the first length that does not; a try
    predicted (from the shorter ones) to exceed host memory or the step time allowed is not run."""
    return LengthSearch(lambda length: try_length(length, path), start=first_length, limit=max_try_length,
                        refine_steps=refine_steps, max_step_seconds=step_limit, host_fraction=host_fraction,
                        label=f"{path:7}").run()

# %%
found = {}
for path in paths:
    print(f"{path}:")
    found[path] = search(path)
    print(f"  stopped: {found[path]['stopped']}")
fast_fits = [row for row in found.get("fastsft", {"tried": {}})["tried"].values() if row["fits"]]
fastsft_attached = fast_fits[-1]["nbkit_attached"] if fast_fits else []
if "fastsft" in found:
    print("FastSFT attached:", ", ".join(fastsft_attached) or "nothing")

# %% [markdown]
# ## Results

# %%
lengths = sorted(set().union(*(found[p]["tried"] for p in paths)))
names = {"trl": "plain TRL", "fastsft": "FastSFT"}


def cell(path, length, key):
    row = found[path]["tried"].get(length)
    if row is None:
        return ""
    if not row["fits"]:
        return "OOM"
    if key == "seconds_per_step":
        return f"{row[key]:.2f} s"
    return fmt_bytes(row[key])


def gap(length):
    """The larger relative difference of loss and gradient norm between the two trainers at `length`."""
    if len(paths) < 2:
        return None
    a, b = (found[p]["tried"].get(length) for p in ("trl", "fastsft"))
    if not (a and b and a["fits"] and b["fits"]):
        return None
    return max(abs(a[k] - b[k]) / abs(a[k]) for k in ("loss", "grad_norm"))


# the memory that runs out first: VRAM on a GPU; on a CPU, host memory (above where the search began)
memory_key, memory_name = ("peak_vram", "peak VRAM") if cuda else ("host_peak", "peak host")
headers = ["tokens"]
for p in paths:
    headers += [f"{memory_name}, {names[p]}", f"s/step, {names[p]}"]
if len(paths) == 2:
    headers.append("loss & grad-norm gap")
table = []
for length in lengths:
    line = [f"{length:,}"]
    for p in paths:
        line += [cell(p, length, memory_key), cell(p, length, "seconds_per_step")]
    if len(paths) == 2:
        g = gap(length)
        line.append("" if g is None else f"{g:.1e}")
    table.append(line)

summary = []
for p in paths:
    fit, oom = found[p]["longest_fit"], found[p]["first_oom"]
    row = found[p]["tried"].get(fit) if fit else None
    summary.append([names[p], f"{fit:,}" if fit else "-", f"{oom:,}" if oom else "-",
                    f"{row['seconds_per_step']:.2f} s" if row else "-",
                    f"{row['tokens_per_second']:,.0f}" if row else "-",
                    fmt_bytes(row["peak_vram"]) if row and row["peak_vram"] is not None else "-",
                    fmt_bytes(row["host_peak"]) if row else "-", found[p]["stopped"]])

gaps = [g for g in map(gap, lengths) if g is not None]
tolerance = 1e-4 if compute_dtype == torch.float32 else 2e-2
results = {
    "cuda": cuda, "model": choice.path, "paths": list(paths), "switches": switches,
    "memory_budget_bytes": budget, "offload_available": offload_available, "missing": missing,
    "fastsft_attached": fastsft_attached,
    "longest_fit": {p: found[p]["longest_fit"] for p in paths},
    "first_oom": {p: found[p]["first_oom"] for p in paths},
    "stopped": {p: found[p]["stopped"] for p in paths},
    "start_length": first_length, "max_step_seconds": step_limit, "host_fraction": host_fraction,
    "tried": {p: {str(k): v for k, v in found[p]["tried"].items()} for p in paths},
    "max_relative_gap": max(gaps) if gaps else None, "tolerance": tolerance,
}
(out / "results.json").write_text(json.dumps(results, indent=2))
for p in paths:
    print(f"{names[p]}: longest that fits {found[p]['longest_fit'] or 0:,} tokens; "
          f"the search stopped: {found[p]['stopped']}")
if gaps:
    print(f"same loss and gradient norm for both trainers: {max(gaps) <= tolerance} "
          f"(max relative gap {max(gaps):.1e}, tolerance {tolerance:.0e})")
if not cuda:
    print("CPU run: no VRAM limit to find (the search stops at host memory, time or its limit); run on a GPU "
          "for the lengths that fit.")
from IPython.display import display

display(md_table(["trainer", "longest that fits", "first out of memory", "s/step there", "tokens/s there",
                  "peak VRAM there", "host memory there (above the start)", "the search stopped"], summary))
display(md_table(headers, table))

# %%
if cuda:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in paths:
        points = sorted((k, v["peak_vram"] / 2**30) for k, v in found[p]["tried"].items() if v["fits"])
        ax.plot([q[0] for q in points], [q[1] for q in points], "o-", label=names[p])
    limit = budget or torch.cuda.get_device_properties(0).total_memory
    ax.axhline(limit / 2**30, color="gray", ls=":", label="GPU memory" + (" (capped)" if budget else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak VRAM (GiB)")
    ax.legend()
    fig.savefig(out / "long_context.png", dpi=100)
    plt.show()
else:
    print("no CUDA GPU: no VRAM chart")
