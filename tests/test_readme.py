"""The README's code runs on a CPU: the "Use it" snippet as written, with only the model name pointed at a local folder
(no hub here) and fewer steps (mixed precision follows the hardware, training runs, and ``chat`` answers); the "Your
own data" script exactly as written (it builds its own local model and data), followed by the "After training"
section's ``chat`` line, as a reader runs them one after the other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _snippet(section: str = "## Use it") -> str:
    """The first python block of ``section``."""
    text = README.read_text()
    return text.split(f"\n{section}\n", 1)[1].split("```python", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_use_it_snippet_runs_as_written_on_a_cpu(tmp_path, monkeypatch, one_thread, capsys):
    from nbkit.demo.models import build_base

    folder = tmp_path / "model"
    build_base(folder, "qwen3", seed=0)
    code = _snippet()
    for text, local in (('"Qwen/Qwen3-1.7B"', repr(str(folder))), ("max_steps=60", "max_steps=3"),
                        ("demo_chat_dataset(2000)", "demo_chat_dataset(64)")):
        assert text in code, f"the README snippet changed: {text} is gone; update this test"
        code = code.replace(text, local)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["trainer"].state.global_step == 3
    assert scope["trainer"].args.bf16 is not True  # fp32 on a CPU, chosen without being asked
    assert capsys.readouterr().out.strip(), "chat printed no answer"  # the greedy line and the sampled one


@pytest.mark.slow
def test_your_own_data_script_runs_as_written_and_trains_the_assistant_turns_only(tmp_path, monkeypatch, one_thread,
                                                                                    capsys):
    code = _snippet("## Your own data")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 20
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "out-mine" / "adapter").iterdir()}
    assert trainer.nbkit_stop_token is not None and trainer.nbkit_stop_token.ok  # the answers' end-of-turn is trained
    # assistant_only_loss: the labels of a prepared row cover the answers and their end of turn, not the questions
    trained = scope["tokenizer"].decode([t for t in trainer.train_dataset[0]["labels"] if t != -100])
    assert "Reverse" not in trained and "user" not in trained and "<|im_end|>" in trained, trained
    # the trained model runs outside the trainer as it trained: its trainable weights in the compute dtype (fp32 on
    # a CPU, not TRL's bf16 QLoRA cast), so the next section's chat line answers
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
    after = _snippet("## After training: chat, merge, GGUF").splitlines()
    lines = [line for line in after if line.startswith(("from nbkit.chat import", "chat("))]
    assert len(lines) == 3 and lines[0].startswith("from"), f"the README's chat lines changed: {lines}; update this test"
    capsys.readouterr()
    exec(compile("\n".join(lines), str(README), "exec"), scope)
    assert capsys.readouterr().out.strip(), "chat printed no answer"  # the greedy line and the sampled one
