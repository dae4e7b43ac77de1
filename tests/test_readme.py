"""The README's "Use it" snippet runs as written on a CPU, with only the model name pointed at a local folder (no
hub here) and fewer steps: mixed precision follows the hardware, training runs, and ``chat`` answers."""

from __future__ import annotations

from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _snippet() -> str:
    text = README.read_text()
    return text.split("## Use it", 1)[1].split("```python", 1)[1].split("```", 1)[0]


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
    assert capsys.readouterr().out.strip(), "chat printed no answer"
