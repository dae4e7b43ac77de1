"""The demo's parts (generated data, shipped tokenizer, tiny models) and ``python -m nbkit demo`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbkit.demo.data import EVAL_SIZE, WORDS, demo_pairs, make_dataset
from nbkit.demo.models import FAMILIES, MOE_FAMILIES, SLIDING_WINDOW, TINY_RECIPE, Recipe, tiny_config, tiny_model
from nbkit.demo.tokenizer import demo_tokenizer_path, load_demo_tokenizer

ROOT = Path(__file__).resolve().parents[1]


# --- data ----------------------------------------------------------------------------------------------------------


def test_pairs_are_reversals_and_deterministic():
    pairs = demo_pairs(200, "train", seed=0)
    assert len(pairs) == 200
    for question, answer in pairs:
        words = question.split(":", 1)[1].split()
        assert 3 <= len(words) <= 4 and set(words) <= set(WORDS)
        assert answer == " ".join(reversed(words))
    assert demo_pairs(200, "train", seed=0) == pairs
    assert demo_pairs(200, "train", seed=1) != pairs


def test_eval_split_is_held_out():
    eval_questions = {q for q, _ in demo_pairs(EVAL_SIZE, "eval")}
    assert len(eval_questions) == EVAL_SIZE
    assert not eval_questions & {q for q, _ in demo_pairs(5000, "train")}
    with pytest.raises(ValueError, match="eval split"):
        demo_pairs(EVAL_SIZE + 1, "eval")
    with pytest.raises(ValueError, match="split"):
        demo_pairs(3, "test")  # type: ignore[arg-type]


def test_dataset_formats_are_what_trl_reads():
    from trl.data_utils import is_conversational

    messages = make_dataset("messages", n=5)
    assert messages.column_names == ["messages"] and len(messages) == 5
    assert is_conversational(messages[0])
    assert [m["role"] for m in messages[0]["messages"]] == ["user", "assistant"]
    prompt = make_dataset("prompt", n=5)
    assert prompt.column_names == ["prompt", "completion"]
    assert prompt[0]["prompt"].endswith("Answer:") and prompt[0]["completion"].startswith(" ")
    text = make_dataset("text", n=5)
    assert text.column_names == ["text"]
    assert text[0]["text"] == prompt[0]["prompt"] + prompt[0]["completion"]
    assert make_dataset("text", n=0).column_names == ["text"]
    with pytest.raises(ValueError, match="format"):
        make_dataset("chat", n=2)  # type: ignore[arg-type]


# --- tokenizer -----------------------------------------------------------------------------------------------------


def test_shipped_tokenizer_is_small_and_loads_offline():
    folder = demo_tokenizer_path()
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 1_000_000, size
    tok = load_demo_tokenizer()
    assert len(tok) == 1024
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for word in WORDS:
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    text = "Any text at all: 123 cafés, emoji 🙂, tabs\tand\nnewlines."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: nothing is unknown


def test_chat_template_marks_the_assistant_turn_with_its_end_of_turn():
    from trl.chat_template_utils import has_generation_markers, is_chat_template_stop_token_trained

    tok = load_demo_tokenizer()
    assert has_generation_markers(tok.chat_template)
    assert is_chat_template_stop_token_trained(tok)
    messages = [{"role": "user", "content": "Reverse the words: red fox sun"},
                {"role": "assistant", "content": "sun fox red"}]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "sun fox red<|im_end|>"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=False).startswith(prompt)


def test_build_script_reproduces_the_shipped_tokenizer(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "build_demo_tokenizer.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    shipped = demo_tokenizer_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (shipped / name).read_text(), name


# --- tiny models ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_are_small_real_architectures(family):
    config = tiny_config(family, 1024)
    assert (config.hidden_size, config.num_hidden_layers) == (128, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    if family in ("mistral", "gemma2", "gemma3", "gpt_oss"):
        assert config.sliding_window == SLIDING_WINDOW
    if family in ("gemma2", "gemma3", "gpt_oss"):
        assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    if family == "gemma2":
        assert config.attn_logit_softcapping and config.final_logit_softcapping
    if family in MOE_FAMILIES:
        assert config.num_local_experts == 4 and config.num_experts_per_tok == 2
    model = tiny_model(family, 1024, seed=1)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and 6.0 < loss.item() < 8.0  # about log(1024) = 6.93 at random init


def test_tiny_model_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_model("llama", 512, seed=7)
    assert torch.equal(torch.rand(3), expected)
    b, c = tiny_model("llama", 512, seed=7), tiny_model("llama", 512, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_tiny_config_overrides_and_special_ids():
    config = tiny_config("gemma2", 1024, num_hidden_layers=2, sliding_window=8)
    assert config.num_hidden_layers == 2 and config.sliding_window == 8
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.pad_token_id, config.eos_token_id) == (0, 1)  # Gemma's defaults fit in 1024
    assert tiny_config("gemma2", 1, eos_token_id=None).pad_token_id == 0
    assert tiny_config("gemma2", 1).eos_token_id is None  # out of range: dropped
    with pytest.raises(ValueError, match="unknown family"):
        tiny_config("gpt2", 1024)


def test_build_base_saves_a_tiny_model_and_the_demo_tokenizer_that_load_back(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.demo.models import build_base

    tokenizer = build_base(tmp_path / "base", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "base")
    assert model.config.vocab_size == len(tokenizer) == len(reloaded) == 1024
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    fresh = tiny_model("llama", 1024, seed=3, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))  # the same seeded weights


def test_a_recipe_keeps_its_values_where_the_given_ones_are_none():
    pretrained = Recipe(max_steps=60, learning_rate=2e-4, batch_size=4, max_length=512)
    assert pretrained.but(max_steps=None, learning_rate=1e-4) == Recipe(60, 1e-4, 4, 512)
    assert TINY_RECIPE.but() == TINY_RECIPE and TINY_RECIPE.modules_to_save == ("embed_tokens", "lm_head")


def test_the_notebook_plumbing_imports_nothing_from_the_demo_cli():
    """nbkit.notebook and nbkit.demo.run share the tiny base (nbkit.demo.models), answer generation
    (nbkit.generation) and memory formatting (nbkit.memory); neither imports the other, and neither formats bytes
    or reads peak memory itself."""
    import ast

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        return found | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}

    def defined(path: Path) -> set[str]:
        return {node.name for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}

    notebook, run = ROOT / "nbkit" / "notebook.py", ROOT / "nbkit" / "demo" / "run.py"
    assert "nbkit.demo.run" not in imports(notebook) and "nbkit.notebook" not in imports(run)
    assert {"nbkit.memory", "nbkit.demo.models"} <= imports(notebook) & imports(run)
    assert "nbkit.generation" in imports(run)
    for path in (notebook, run):
        assert not defined(path) & {"fmt_bytes", "_fmt_bytes", "peak_memory_bytes", "build_base", "generate_answers"}


def test_demo_help_lists_the_families_explains_the_seed_and_shows_the_output_dir_default(capsys, monkeypatch):
    from nbkit.demo.run import DEFAULT_OUTPUT_DIR, parse_args

    monkeypatch.setenv("COLUMNS", "400")  # one line per option: argparse would wrap inside "nbkit-demo-out"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"model family: {', '.join(FAMILIES)} (default qwen3)" in text
    assert "--seed SEED seed of the base model's weights, the data, LoRA's init and the trainer (default 0)" in text
    assert f"(default {DEFAULT_OUTPUT_DIR})" in text
    args = parse_args([])
    assert (args.max_steps, args.learning_rate, args.batch_size, args.max_length) == (
        TINY_RECIPE.max_steps, TINY_RECIPE.learning_rate, TINY_RECIPE.batch_size, TINY_RECIPE.max_length)


# --- python -m nbkit demo ------------------------------------------------------------------------------------------

SHORT = ["--max-steps", "40", "--eval-examples", "16", "--save-steps", "0"]


def _demo(out: Path, *extra: str, timeout: int = 240) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "nbkit", "demo", "--output-dir", str(out), "--json", str(out / "metrics.json"),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "exact match" in proc.stdout
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory) -> dict:
    return _demo(tmp_path_factory.mktemp("demo-fast"), *SHORT)


@pytest.mark.slow
def test_demo_short_run_trains_and_reports(fast_run):
    m = fast_run
    assert m["trainer"] == "FastSFT" and m["family"] == "qwen3" and m["load_in_4bit"]
    assert m["steps"] == 40 and len(m["losses"]) == 40
    assert m["loss_last"] < m["loss_first"] - 2.0, (m["loss_first"], m["loss_last"])
    assert m["eval_loss_after"] < m["eval_loss_before"] - 2.0
    assert m["tokens_per_second"] > 0 and m["tokens"] > 40 * 256  # two packed rows of up to 256 tokens a step
    assert m["peak_memory_bytes"] > 50 * 2**20
    assert 0.8 < m["packing_efficiency"] <= 1.0
    assert 0.0 <= m["eval_accuracy_before"] <= 1.0 and 0.0 <= m["eval_accuracy_after"] <= 1.0
    assert len(m["samples"]) == 16


@pytest.mark.slow
def test_demo_adapter_reloads_to_the_trained_model(fast_run):
    """The saved adapter on the saved base gives the held-out loss and the answers measured right after training."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from nbkit.demo.run import assistant_loss
    from nbkit.generation import generate_answers
    from nbkit.loading import keep_4bit_trainable

    m = fast_run
    adapter = Path(m["adapter_dir"])
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(m["base_dir"], quantization_config=quant, dtype=torch.float32)
    keep_4bit_trainable(base)  # the same 4-bit kernels as during the run
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(base, adapter)
    pairs = demo_pairs(m["eval_examples"], "eval", seed=m["seed"])
    assert abs(assistant_loss(model, tokenizer, pairs) - m["eval_loss_after"]) < 1e-3
    with model.disable_adapter():
        assert abs(assistant_loss(model, tokenizer, pairs) - m["eval_loss_before"]) < 1e-3
    answers = generate_answers(model, tokenizer, [s["question"] for s in m["samples"]])
    assert answers == [s["after"] for s in m["samples"]]


@pytest.mark.slow
def test_demo_baseline_runs_the_same_training(fast_run, tmp_path):
    """--baseline trains through TRL's SFTTrainer on the same data, seed and adapter init: the same first loss."""
    m = _demo(tmp_path, *SHORT, "--baseline")
    assert m["trainer"] == "SFTTrainer"
    assert m["steps"] == fast_run["steps"]
    assert abs(m["loss_first"] - fast_run["loss_first"]) < 1e-4
    assert m["loss_last"] < m["loss_first"] - 2.0


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NBKIT_TEST_FULL_DEMO") != "1",
                    reason="the full default demo takes ~1 min on 2 CPU cores: set NBKIT_TEST_FULL_DEMO=1")
def test_demo_default_run_learns_the_skill(tmp_path):
    """The default run (what a user gets): from no correct answer to nearly all held-out prompts right."""
    m = _demo(tmp_path, "--save-steps", "0", timeout=600)
    assert m["eval_accuracy_before"] == 0.0
    assert m["eval_accuracy_after"] >= 0.9, m["eval_accuracy_after"]
    assert m["loss_last"] < 0.2


def test_demo_rejects_bad_options():
    from nbkit.demo.run import parse_args

    for argv in (["--family", "gpt2"], ["--max-steps", "0"], ["--threads", "0"], ["--eval-examples", "257"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert parse_args([]).family == "qwen3" and parse_args(["--no-4bit"]).load_in_4bit is False


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_demo_answers_reach_decode_steps_on_a_moe_model_left_in_trls_training_state(family):
    """TRL's SFTTrainer sets output_router_logits=True (plain TRL keeps it after train()); the demo's and the
    notebooks' answers must still decode (a padded generate used to fail at its first decode step)."""
    from nbkit.generation import generate_answers

    tok = load_demo_tokenizer()
    model = tiny_model(family, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.config.output_router_logits = True  # what SFTTrainer.__init__ leaves on a MoE config
    questions = ["Reverse the words: red fox", "Reverse the words: one two three four five"]  # different lengths: padded
    answers = generate_answers(model, tok, questions, max_new_tokens=4, min_new_tokens=4)
    assert len(answers) == 2
    assert model.config.output_router_logits is True  # the caller's config is left as it was


def test_demo_report_ends_with_next_steps_that_the_clis_and_load_model_take(tmp_path):
    """After the numbers, the demo says how to chat with the adapter and export it: commands that parse as given."""
    import shlex

    from nbkit.demo.run import next_steps, parse_args
    from nbkit.export.cli import parse as parse_export

    adapter = tmp_path / "my out" / "adapter"
    lines = next_steps(str(adapter))
    text = "\n".join(lines)
    assert f"load_model({json.dumps(str(adapter))})" in text and "chat(model, tokenizer, " in text
    export = next(line.strip() for line in lines if "python -m nbkit export" in line)
    args = parse_export(shlex.split(export)[4:])
    assert Path(args.source) == adapter and args.to == "gguf" and args.quant == "q8_0"
    assert Path(args.out).parent == adapter.parent
    baseline = next(line for line in lines if "--baseline" in line).split(": ", 1)[1]
    assert parse_args(shlex.split(baseline)[4:]).baseline
    assert not any("--baseline" in line for line in next_steps(str(adapter), fastsft=False))
