"""Write the example notebooks in notebooks/ from the cell sources below (run from anywhere).

Why a generator: a notebook is JSON with outputs, execution counts, widget state and random cell ids; reviewing
it means reading that JSON. Here every cell is plain text in one Python file, and the written notebooks carry no
outputs, no widget state and stable cell ids, so a diff of a notebook is a diff of its cells.

    python tools/make_notebooks.py           # (re)write notebooks/*.ipynb
    python tools/make_notebooks.py --check   # exit 1 if a committed notebook differs from what this file makes

Each notebook's first code cell is tagged ``parameters`` (papermill's convention; nbclient runs can insert an
overriding cell after it), and each notebook runs top to bottom on a GPU with a real model, or on a CPU with a tiny
local model when there is no GPU (``model_name="auto"``).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "notebooks"


def md(text: str) -> tuple[str, str]:
    return ("markdown", textwrap.dedent(text).strip("\n"))


def code(text: str, *tags: str) -> tuple[str, str, tuple[str, ...]]:
    return ("code", textwrap.dedent(text).strip("\n"), tags)


def params(text: str, name: str) -> tuple[str, str, tuple[str, ...]]:
    """The first code cell: this notebook's parameters, then the ones every notebook has."""
    body = textwrap.dedent(text).strip("\n") + "\n" + PARAMS_COMMON.format(name=name).strip("\n")
    return ("code", body, ("parameters",))


# ---------------------------------------------------------------------------------------------------------------
# cells shared by every notebook

PARAMS_COMMON = """
output_dir = "nbkit-out/{name}"  # everything this notebook writes goes here
nbkit_source = "nbkit-sft @ git+https://github.com/nbkit/nbkit"  # what setup installs: this, a wheel or a checkout
run_setup = "auto"  # "auto": run colab_setup.sh on Colab/Kaggle only; True: always; False: never
setup_options = []  # more colab_setup.sh options: ["--flash"] adds flash-attn if a prebuilt wheel fits
seed = 0
"""

SETUP = code('''
    # Setup. On Colab or Kaggle: install nbkit without touching the runtime's torch. nbkit goes in alone first
    # (--no-deps: nothing is resolved, so nothing can replace torch), then its colab_setup.sh pins torch and
    # installs the rest. Its distribution is named nbkit-sft (the import stays `nbkit`): "nbkit" on PyPI is another
    # project, whose files would shadow these, so a distribution of that name is removed first. Elsewhere (your
    # machine, CI) this cell does nothing: pip install "nbkit-sft @ git+https://github.com/nbkit/nbkit" yourself.
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
''')


def intro_setup_md(cpu_time: str, extra: str = "") -> tuple[str, str]:
    """The "Run it" cell; ``cpu_time``: how long the whole notebook takes on a 2-core CPU with its defaults, as
    measured (tests/test_notebooks.py runs each notebook on a CPU)."""
    return md(f"""
    **Run it**: *Run all*. The first code cell holds the parameters (tagged `parameters`, so papermill or nbclient
    can override them). With `model_name="auto"` the notebook trains the real model on a GPU, and with no GPU a tiny
    randomly initialised model of the same architecture, saved to a local folder with nbkit's demo tokenizer, so the
    whole notebook also runs on a CPU: {cpu_time} on two cores with these defaults. Both go through the same
    `nbkit.load_model(path)` call. {extra}
    """)


# ---------------------------------------------------------------------------------------------------------------
# 01: QLoRA quickstart

NB01 = [
    md("""
    # QLoRA fine-tuning in one notebook, with nbkit

    Load a model in 4-bit with LoRA adapters, build a chat dataset with the model's own chat template, train with
    `nbkit.FastSFT` while the live dashboard shows speed, loss and memory, compare answers before and after, chat with
    the trained model (streamed), save the adapter, merge it into a 16-bit model, export a GGUF file for llama.cpp /
    Ollama (pure Python: nothing to build), and reload each to check it is what was trained.

    The task is nbkit's shipped demo: *reverse the words* (`"Reverse the words: red fox moon"` ->
    `"moon fox red"`). It is generated, so it needs no download, and scored on held-out prompts.
    """),
    intro_setup_md("about a minute"),
    params("""
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
    own_data = None  # path of a JSONL file with one {"messages": [...]} per line, to train on instead of the demo
    gguf_quant = "q8_0"  # GGUF type: f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 (nbkit.export.QUANT_TYPES)
    """, "01_qlora_quickstart"),
    SETUP,
    md("## The model"),
    code("""
    import gc
    import json
    from pathlib import Path

    import torch

    import nbkit
    from nbkit import FastSFT, FastSFTConfig, load_model
    from nbkit.demo.models import Recipe
    from nbkit.loading import pick_compute_dtype
    from nbkit.memory import fmt_bytes
    from nbkit.notebook import (RunProbe, answers, demo_chat_dataset, exact_match, keep_trainable_fp32, md_table,
                                pick_model, sequence_loss, to_prompt_completion)

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
    """),
    code("""
    torch.manual_seed(seed)  # LoRA's initial A matrices
    model, tokenizer = load_model(
        choice.path,
        load_in_4bit=load_in_4bit,
        lora_r=lora_r,
        max_seq_length=recipe.max_length,
        # the tiny recipe trains embeddings and head in full: a random-init model has none for LoRA to steer
        modules_to_save=list(recipe.modules_to_save) or None,
    )
    model.print_trainable_parameters()
    """),
    md("""
    ## The data, in the model's chat template

    Rows are conversations. nbkit's notebooks use TRL's *conversational prompt-completion* format (`prompt`: the
    turns before the answer, `completion`: the assistant's answer), so the loss covers the answer only, whatever the
    chat template. The cell prints one example as the model will read it.
    """),
    code("""
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
    """),
    md("""
    ### Your own data

    One JSON object per line with a `messages` list of `{"role", "content"}` turns (system, user, assistant); the
    last turn is the answer to learn (rows with `prompt` and `completion` are taken as they are). The cell writes
    two such rows and loads them exactly as `own_data` would be, with `nbkit.load_jsonl`: an empty file or a line
    that is not a JSON object is named by its line number.
    Other column names? Map them to `messages` first, e.g. for `instruction` / `output` columns:

    ```python
    ds = ds.map(lambda r: {"messages": [{"role": "user", "content": r["instruction"]},
                                        {"role": "assistant", "content": r["output"]}]})
    ```

    Then set `own_data = "my_chats.jsonl"` in the parameters and run all again.
    """),
    code("""
    my_file = out / "my_chats.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "Paris"}]},
        {"messages": [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "What colour is the sky on a clear day?"},
                      {"role": "assistant", "content": "Blue"}]},
    ]
    my_file.write_text("".join(json.dumps(row) + "\\n" for row in rows))
    mine = to_prompt_completion(load_jsonl(my_file))
    print(mine)
    print(tokenizer.apply_chat_template(mine[0]["prompt"] + mine[0]["completion"], tokenize=False))
    """),
    md("## Before training: answers on held-out prompts"),
    code("""
    eval_pairs = demo_pairs(eval_examples, split="eval", seed=seed)
    questions = [q for q, _ in eval_pairs]
    references = [a for _, a in eval_pairs]
    before = answers(model, tokenizer, questions)
    results["loss_before"] = sequence_loss(model, tokenizer, eval_pairs)
    results["exact_match_before"] = exact_match(before, references)
    print(f"exact match before training: {results['exact_match_before']:.0%}, "
          f"held-out loss {results['loss_before']:.3f}")
    """),
    md("""
    ## Train with FastSFT and the live dashboard

    `FastSFT` takes `SFTTrainer`'s arguments. In a notebook it shows `nbkit.LiveDashboard` by itself (one panel
    updated in place: progress, tokens/s, loss, learning rate, VRAM, RAM), which becomes a static summary at the end.
    """),
    code("""
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
    trainer.train()
    """),
    code("""
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
        ["loss", f"{results['loss_first']:.3f} -> {results['loss_last']:.3f}"],
        ["tokens/s (after the first step)", f"{results['tokens_per_second']:,.0f}"],
        ["peak VRAM", fmt_bytes(results["peak_vram"])],
        ["nbkit speedups used", ", ".join(results["nbkit_attached"]) or "none"],
    ])
    """),
    md("## After training: the same prompts"),
    code("""
    after = answers(model, tokenizer, questions)
    results["exact_match_after"] = exact_match(after, references)
    results["answers_after"] = after
    results["loss_trained"] = sequence_loss(model, tokenizer, eval_pairs)
    print(f"exact match: {results['exact_match_before']:.0%} -> {results['exact_match_after']:.0%}; "
          f"held-out loss {results['loss_before']:.3f} -> {results['loss_trained']:.3f}")
    md_table(["question", "expected", "before", "after"],
             [[q, r, b, a] for q, r, b, a in list(zip(questions, references, before, after))[:8]])
    """),
    md("""
    ## Chat with it

    `nbkit.chat.chat` applies the chat template, streams the answer as it is generated and stops at the template's
    end-of-turn token; on a GPU it decodes through a captured CUDA-graph step (the same tokens as `generate`, faster).
    """),
    code("""
    from nbkit.chat import chat

    question = questions[0]
    print("Q:", question)
    print("A: ", end="")
    results["chat_reply"] = chat(model, tokenizer, question, max_new_tokens=32)
    """),
    md("## Save the adapter, reload it, check it"),
    code("""
    adapter_dir = out / "adapter"
    trainer.save_model(str(adapter_dir))  # the LoRA weights (and tokenizer), not the base model
    results["adapter_files"] = sorted(p.name for p in adapter_dir.iterdir())
    print(adapter_dir, results["adapter_files"])
    """),
    code("""
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
    results["loss_reloaded"] = sequence_loss(reloaded, tokenizer, eval_pairs)
    tolerance = 1e-4 if compute_dtype == torch.float32 else 1e-2
    gap = abs(results["loss_reloaded"] - results["loss_trained"]) / results["loss_trained"]
    print(f"held-out loss: trained {results['loss_trained']:.5f}, reloaded adapter {results['loss_reloaded']:.5f} "
          f"(relative gap {gap:.1e}, tolerance {tolerance:.0e})")
    assert gap <= tolerance, "the reloaded adapter is not the trained one"
    del reloaded, base
    """),
    md("""
    ## Merge into a 16-bit model

    Merging into the 4-bit base would round the result back to 4 bits. Instead the base is loaded in 16-bit and the
    adapter added to it, giving a standalone checkpoint any transformers (or vLLM, llama.cpp converter...) user can
    load. It differs from the 4-bit model you trained by the base's quantization error, so the check is that it
    keeps what training taught it.
    """),
    code("""
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
    """),
    code("""
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=merge_dtype, device_map=device_map)
    merged_tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    results["merged_dtype"] = str(merged.dtype).replace("torch.", "")
    results["loss_merged"] = sequence_loss(merged, merged_tokenizer, eval_pairs)
    merged_answers = answers(merged, merged_tokenizer, questions)
    results["exact_match_merged"] = exact_match(merged_answers, references)
    results["merged_agrees_with_adapter"] = exact_match(merged_answers, after)
    print(f"merged {results['merged_dtype']} model: held-out loss {results['loss_merged']:.3f} "
          f"(before training {results['loss_before']:.3f}, trained 4-bit {results['loss_trained']:.3f}); "
          f"exact match {results['exact_match_merged']:.0%}; same answer as the adapter on "
          f"{results['merged_agrees_with_adapter']:.0%} of prompts")
    assert results["loss_merged"] < results["loss_before"], "the merged model lost what training taught it"
    """),
    md("""
    ## Export GGUF for llama.cpp and Ollama

    Written in pure Python with the `gguf` package (llama.cpp's own writer): no llama.cpp build, no download. The file
    is read back with transformers' GGUF reader and its logits compared with the merged model's; an Ollama
    `Modelfile` (template and stop tokens) is written beside it: `ollama create my-model -f Modelfile`.
    """),
    code("""
    from nbkit.export import export_gguf

    gguf_report = export_gguf(merged_dir, out / "gguf" / f"model-{gguf_quant}.gguf", quant=gguf_quant)
    results["gguf"] = gguf_report.as_dict()
    print(gguf_report.path, f"({gguf_report.path.stat().st_size / 2**20:.1f} MiB)")
    print(gguf_report.modelfile.read_text())
    """),
    code("""
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
    """),
    md("## Summary"),
    code("""
    (out / "results.json").write_text(json.dumps(results, indent=2))
    md_table(["", ""], [
        ["model", choice.describe()],
        ["loss (training)", f"{results['loss_first']:.3f} -> {results['loss_last']:.3f}"],
        ["tokens/s", f"{results['tokens_per_second']:,.0f}"],
        ["peak VRAM", fmt_bytes(results["peak_vram"])],
        ["exact match", f"{results['exact_match_before']:.0%} -> {results['exact_match_after']:.0%} "
                        f"(merged: {results['exact_match_merged']:.0%})"],
        ["adapter", str(adapter_dir)],
        ["merged 16-bit model", str(merged_dir)],
        ["GGUF", f"{gguf_report.path} ({gguf_quant})"],
        ["all numbers", str(out / "results.json")],
    ])
    """),
]

# ---------------------------------------------------------------------------------------------------------------
# 02: speed lab

NB02 = [
    md("""
    # Speed lab: every nbkit switch on and off, next to plain TRL

    The same short run (same model, data, seed and hyper-parameters) with TRL's plain `SFTTrainer`, with
    `nbkit.FastSFT` as it comes, and with `FastSFT` with one switch of `FastSFTConfig` flipped at a time. For each:
    tokens/s (TRL's token count, first step left out) and peak VRAM as bars, and the loss curves overlaid. The
    switches change speed and memory only, so every run's first step gives plain TRL's loss and gradient norm (up to
    rounding), and the curves stay close after it.

    On a CPU the tiny model's numbers measure Python and framework overhead, not GPU kernels: read the speed bars on
    a GPU. The loss overlay means the same everywhere.
    """),
    intro_setup_md("7 to 20 minutes (every variant trains 30 steps; a smaller `max_steps` gives a quicker look)"),
    params("""
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
    """, "02_speed_lab"),
    SETUP,
    code("""
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
    """),
    code("""
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
        seed=seed,
    )


    def run_variant(name, overrides):
        \"\"\"Load the model afresh (same seed: same LoRA init), train, measure, free.\"\"\"
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
    """),
    md("## The runs"),
    code("""
    rows = []
    for name in chosen:
        print(f"=== {name}")
        rows.append(run_variant(name, ALL_VARIANTS[name]))
        print(f"    {rows[-1]['tokens_per_second']:,.0f} tokens/s, peak VRAM {fmt_bytes(rows[-1]['peak_vram'])}, "
              f"nbkit: {', '.join(rows[-1]['nbkit_attached']) or '-'}")
    """),
    md("""
    ## Results

    Every run starts from the same weights and sees the same batches, so at step 1 each must give the reference's
    loss and gradient norm, up to the rounding of sums taken in another order: that is the check (1e-4 relative in
    fp32, 2e-2 in bf16/fp16, as in `03_long_context`). From step 2 on, each run's rounding has changed its weights a
    little and training carries that forward, so the curves part slowly, by more the longer the run: the largest gap
    over the whole run is in the table, not held to the first step's tolerance.
    """),
    code("""
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
    """),
    code("""
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
        ax_mem.text(0.5, 0.5, "no CUDA GPU:\\npeak VRAM not measured", ha="center", va="center", fontsize=12)
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
    """),
]

# ---------------------------------------------------------------------------------------------------------------
# 03: long context

NB03 = [
    md("""
    # Long context: the longest sequence that trains on this GPU, plain TRL against FastSFT

    How long a row fits decides whether you can fine-tune on long documents at all. This notebook finds, on your GPU
    and your model, the longest single sequence (batch 1, gradient checkpointing) that trains with TRL's plain
    `SFTTrainer` and with `FastSFT` on its defaults, and shows the table: longest fit, first out-of-memory, peak
    VRAM, host memory, step time and tokens/s, and whether both trainers give the same loss and gradient norm at the
    lengths where both fit. It is the method of nbkit's long-context benchmark (`python -m benchmarks.long_context`,
    BENCHMARKS.md section 10), with your GPU as the budget.

    What FastSFT does for a long row, each a switch of `FastSFTConfig`: offloaded checkpointing (each layer's saved
    input waits in pinned host memory and is copied back, double-buffered, before its recompute), the MLP tiled over
    the sequence when a call would not fit (`tiled_mlp="auto"`), varlen attention (nothing of size L x L) and the loss
    without the L x vocabulary logits. The price of the offload is host memory, about `layers x hidden x 2` bytes per
    token: on a host with little RAM (free Colab has ~12 GB) cap it with
    `fastsft_switches = {"offload_max_host_bytes": 6 * 2**30}`; the inputs past the cap stay on the GPU.

    Running out of GPU memory is an error the search catches; running out of host memory is not (the kernel kills
    the process, and the notebook with it). So before each try the search predicts, from the tries at shorter
    lengths, the host memory and the time a step will take, and does not run a try that would exceed `host_fraction`
    of the available host memory or `max_step_seconds`; it says where it stopped and why. `memory_budget_gib` lets a
    large GPU stand in for a smaller card (PyTorch's per-process memory cap). On a CPU there is no VRAM to run out of:
    the search stops at host memory, time or its limit, and the CPU run shows that both paths run and agree.
    """),
    intro_setup_md("about a minute"),
    params("""
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
    """, "03_long_context"),
    SETUP,
    md("## What FastSFT has here"),
    code("""
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
    """),
    code("""
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
    """),
    md("""
    ### What a token costs

    Arithmetic, not a measurement: the checkpointed layer inputs are what offloading moves to host memory; the
    logits (in fp32 inside a plain loss, and their gradient) are what a loss without full logits never builds.
    """),
    code("""
    element = torch.tensor([], dtype=compute_dtype).element_size()
    per_token_checkpoints = layers * hidden * element
    per_token_logits = vocab * (element + 4 + 4)  # logits, their fp32 copy in the loss, its gradient
    md_table(["per token", "bytes", "at 32k tokens"], [
        [f"checkpointed layer inputs ({layers} layers x {hidden} x {element} B)", f"{per_token_checkpoints:,}",
         fmt_bytes(per_token_checkpoints * 32768)],
        [f"full logits and their gradient ({vocab:,} vocabulary)", f"{per_token_logits:,}",
         fmt_bytes(per_token_logits * 32768)],
    ])
    """),
    md("## One training step per length"),
    code("""
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
        \"\"\"Train `steps_per_try` steps on one sequence of `length` tokens with `path`'s trainer. Learning rate 0:
        every try starts from the same weights, so the two trainers' losses and gradient norms can be compared.\"\"\"
        common = dict(
            output_dir=str(out / "trainer"), max_steps=steps_per_try, per_device_train_batch_size=1,
            learning_rate=0.0, max_length=length, packing=False, bf16=compute_dtype == torch.bfloat16,
            fp16=compute_dtype == torch.float16, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=seed,
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
        \"\"\"Double from first_length while it fits, then bisect towards the first length that does not; a try
        predicted (from the shorter ones) to exceed host memory or the step time allowed is not run.\"\"\"
        return LengthSearch(lambda length: try_length(length, path), start=first_length, limit=max_try_length,
                            refine_steps=refine_steps, max_step_seconds=step_limit, host_fraction=host_fraction,
                            label=f"{path:7}").run()
    """),
    code("""
    found = {}
    for path in paths:
        print(f"{path}:")
        found[path] = search(path)
        print(f"  stopped: {found[path]['stopped']}")
    fast_fits = [row for row in found.get("fastsft", {"tried": {}})["tried"].values() if row["fits"]]
    fastsft_attached = fast_fits[-1]["nbkit_attached"] if fast_fits else []
    if "fastsft" in found:
        print("FastSFT attached:", ", ".join(fastsft_attached) or "nothing")
    """),
    md("## Results"),
    code("""
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
        \"\"\"The larger relative difference of loss and gradient norm between the two trainers at `length`.\"\"\"
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
    """),
    code("""
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
    """),
]

# ---------------------------------------------------------------------------------------------------------------
# 04: MoE fine-tune

NB04 = [
    md("""
    # Fine-tune a mixture-of-experts model

    QLoRA on an MoE model: Qwen3-30B-A3B (128 experts, 8 per token) or gpt-oss-20b on a GPU, a tiny
    `qwen3_moe` (4 experts, 2 per token) on a CPU. PEFT's `all-linear` LoRA reaches the attention projections, the
    router and the fused expert weights; `FastSFTConfig(fast_moe_routing=True)` (the default) runs the experts through
    nbkit's routing (one sort by expert, contiguous slices or one grouped matmul, LoRA on experts as low-rank
    products). The notebook trains with it, checks the result, then trains again with it off to compare speed and loss.

    Memory: bitsandbytes quantizes linear layers only; fused 3-D expert weights stay in 16-bit. Qwen3-30B-A3B then
    needs about 65 GB of GPU memory (an 80 GB A100/H100 or an H200), gpt-oss-20b about 45 GB. For gpt-oss-20b set
    `load_in_4bit=False`: its experts ship in MXFP4, which transformers dequantizes to bf16 for training.
    """),
    intro_setup_md("about four minutes"),
    params("""
    # Parameters
    model_name = "auto"  # "auto": Qwen/Qwen3-30B-A3B on a GPU, a tiny local qwen3_moe without one; "openai/gpt-oss-20b"
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
    """, "04_moe_finetune"),
    SETUP,
    md("## Is nbkit's MoE routing there?"),
    code("""
    import gc
    import json
    from pathlib import Path

    import torch

    import nbkit
    from nbkit import FastSFT, FastSFTConfig, load_model
    from nbkit.demo.data import demo_pairs
    from nbkit.loading import pick_compute_dtype
    from nbkit.memory import fmt_bytes
    from nbkit.notebook import (RunProbe, answers, demo_chat_dataset, exact_match, feature, keep_trainable_fp32,
                                md_table, pick_model, sequence_loss)

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
    """),
    md("## The model"),
    code("""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    compute_dtype = pick_compute_dtype()
    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    choice = pick_model(model_name, gpu_default="Qwen/Qwen3-30B-A3B", tiny_family=tiny_family,
                        folder=out / "tiny-base", seed=seed)
    lr = learning_rate if learning_rate is not None else (3e-3 if choice.tiny else 1e-4)
    print(f"nbkit {nbkit.__version__}, torch {torch.__version__}, {gpu}, compute dtype {compute_dtype}")
    print("model:", choice.describe())


    def load():
        torch.manual_seed(seed)
        return load_model(choice.path, load_in_4bit=load_in_4bit, lora_r=lora_r, max_seq_length=max_length,
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
    """),
    md("## Data and answers before training"),
    code("""
    train_dataset = demo_chat_dataset(train_examples, split="train", seed=seed)
    eval_pairs = demo_pairs(eval_examples, split="eval", seed=seed)
    questions = [q for q, _ in eval_pairs]
    references = [a for _, a in eval_pairs]
    before = answers(model, tokenizer, questions)
    results["loss_before"] = sequence_loss(model, tokenizer, eval_pairs)
    results["exact_match_before"] = exact_match(before, references)
    print(f"exact match before: {results['exact_match_before']:.0%}, held-out loss {results['loss_before']:.3f}")
    """),
    md("## Train with FastSFT (fast MoE routing on, where this nbkit has it)"),
    code("""
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
    """),
    md("## After training"),
    code("""
    after = answers(model, tokenizer, questions)
    results["exact_match_after"] = exact_match(after, references)
    results["answers_after"] = after
    results["loss_trained"] = sequence_loss(model, tokenizer, eval_pairs)
    print(f"exact match {results['exact_match_before']:.0%} -> {results['exact_match_after']:.0%}; "
          f"held-out loss {results['loss_before']:.3f} -> {results['loss_trained']:.3f}")
    md_table(["question", "expected", "before", "after"],
             [[q, r, b, a] for q, r, b, a in list(zip(questions, references, before, after))[:6]])
    """),
    md("""
    ## Chat with it

    `nbkit.chat.chat` applies the chat template, streams the answer and stops at the template's end-of-turn token.
    """),
    code("""
    from nbkit.chat import chat

    print("Q:", questions[0])
    print("A: ", end="")
    results["chat_reply"] = chat(model, tokenizer, questions[0], max_new_tokens=32)
    """),
    md("## Save the adapter, reload it, check it"),
    code("""
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
    results["loss_reloaded"] = sequence_loss(reloaded, tokenizer, eval_pairs)
    tolerance = 1e-4 if compute_dtype == torch.float32 else 1e-2
    gap = abs(results["loss_reloaded"] - results["loss_trained"]) / results["loss_trained"]
    print(f"adapter saved to {adapter_dir}; reloaded: held-out loss {results['loss_reloaded']:.5f} vs trained "
          f"{results['loss_trained']:.5f} (relative gap {gap:.1e}, tolerance {tolerance:.0e})")
    assert gap <= tolerance, "the reloaded adapter is not the trained one"
    del reloaded, base
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    """),
    md("""
    ## The same run with fast MoE routing off

    Both runs start from the same weights and see the same batches, so at step 1 the two experts paths must give the
    same loss and gradient norm, up to the rounding of sums taken in another order: that is the check (1e-4 relative
    in fp32, 2e-2 in bf16/fp16, as in `03_long_context`). From step 2 on, each path's rounding has changed its
    weights a little, and training carries that forward step after step, most where the loss falls fastest: the
    curves stay close but part slowly, by more the longer the run, as any two runs whose sums round differently do.
    Their largest gap is printed beside the check, not held to the first step's tolerance.
    """),
    code("""
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
    (out / "results.json").write_text(json.dumps(results, indent=2))
    """),
    md("""
    ## Merge and export GGUF for llama.cpp and Ollama

    The adapter is merged into the original 16-bit base (checked by logits against the adapter model), then written
    as one GGUF file: each layer's experts stacked as llama.cpp reads them (`ffn_gate_exps`, `ffn_up_exps`,
    `ffn_down_exps`), the router kept in float32, an Ollama `Modelfile` beside it. The file is read back and its
    logits compared with the merged model's: by transformers' GGUF reader for Qwen3-MoE, by nbkit's own reader for
    Mixtral (transformers reads no llama with experts). gpt-oss is not exported; the message says what llama.cpp's
    format needs.
    """),
    code("""
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
    (out / "results.json").write_text(json.dumps(results, indent=2))
    """),
]

NOTEBOOKS = {
    "01_qlora_quickstart": NB01,
    "02_speed_lab": NB02,
    "03_long_context": NB03,
    "04_moe_finetune": NB04,
}


def build(name: str, cells: list) -> nbformat.NotebookNode:
    """A clean notebook: no outputs, no execution counts, no widget state; cell ids derived from the name."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",  # Colab: ask for a GPU runtime
    }
    for i, cell in enumerate(cells):
        if cell[0] == "markdown":
            new = nbformat.v4.new_markdown_cell(cell[1])
        else:
            new = nbformat.v4.new_code_cell(cell[1])
            if cell[2]:
                new.metadata["tags"] = list(cell[2])
        new.id = f"{name[:2]}-{i:02d}"
        nb.cells.append(new)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name, NOTEBOOKS[name])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a notebook differs from this generator")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write to (default notebooks/)")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = args.out / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run python tools/make_notebooks.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
