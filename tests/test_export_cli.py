"""``python -m nbkit export``: the demo's saved adapter as SOURCE, to merged weights and to GGUF; a model folder as
SOURCE; clear failures; the Hub upload refused offline with the files already written."""

from __future__ import annotations

import json
import shutil

import pytest

from nbkit.export.cli import main


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    """What ``python -m nbkit demo`` saves (a tiny base and a trained adapter), from a 2-step run."""
    from nbkit.demo.run import main as demo

    folder = tmp_path_factory.mktemp("demo")
    demo(["--max-steps", "2", "--output-dir", str(folder), "--eval-examples", "1", "--save-steps", "0"])
    return folder


def test_the_demo_adapter_exports_to_merged_weights(demo_out, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert main([str(demo_out / "adapter"), "--to", "merged", "--out", str(tmp_path / "merged")]) == 0
    report = json.loads((tmp_path / "merged" / "nbkit-export.json").read_text())
    assert report["base_weights"] == f"original weights of {demo_out / 'base'}" and report["check"]["ok"]
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert "merged (reloaded) vs adapter model" in capsys.readouterr().out


def test_the_merge_is_checked_against_the_floor_of_the_dtype_asked_for(demo_out, tmp_path):
    for dtype, floor_is_zero in (("float32", True), ("bfloat16", False)):
        out = tmp_path / dtype
        assert main([str(demo_out / "adapter"), "--to", "merged", "--dtype", dtype, "--out", str(out)]) == 0
        report = json.loads((out / "nbkit-export.json").read_text())
        assert report["dtype"] == dtype and report["check"]["ok"] and report["merge"]["ok"]
        assert (report["floor"]["rel"] == 0) == floor_is_zero, report["floor"]
        assert report["check"]["tolerance"] == pytest.approx(2 * report["floor"]["rel"] + 1e-4)
        assert report["effect"]["rel"] > 1e-3  # the demo's adapter changes the logits: a dropped one is seen


def test_a_wrong_merge_exits_1_saying_what_looks_wrong_and_how_to_go_on(demo_out, tmp_path, monkeypatch, capsys):
    import nbkit.export.merge as merge

    # the LoRA layers dropped (the demo's trained embeddings, modules_to_save, stay)
    monkeypatch.setattr(merge, "_merge", lambda model: model.unload())
    assert main([str(demo_out / "adapter"), "--to", "gguf", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "check failed: merged in float32 vs adapter model" in err and "times the adapter's change" in err
    assert "Nothing was saved" in err and "--no-check" in err
    assert not list(tmp_path.glob("*.gguf"))
    assert main([str(demo_out / "adapter"), "--to", "gguf", "--out", str(tmp_path), "--no-check"]) == 0


def test_the_demo_adapter_exports_to_gguf_with_a_modelfile(demo_out, tmp_path):
    assert main([str(demo_out / "adapter"), "--to", "gguf", "--quant", "q8_0", "--out", str(tmp_path)]) == 0
    gguf_file = tmp_path / f"{demo_out.name}-q8_0.gguf"
    report = json.loads(gguf_file.with_suffix(".export.json").read_text())
    assert report["check"]["ok"] and report["tokenizer_round_trip"] and report["arch"] == "qwen3"
    assert (tmp_path / "Modelfile").read_text().startswith(f"FROM ./{gguf_file.name}")


def test_a_model_folder_exports_to_a_named_gguf_file_and_cannot_be_merged(demo_out, tmp_path):
    target = tmp_path / "base.gguf"
    assert main([str(demo_out / "base"), "--to", "gguf", "--out", str(target), "--no-check"]) == 0
    assert target.is_file()
    assert main([str(demo_out / "base"), "--to", "merged", "--out", str(tmp_path / "m")]) == 2


def demo_run_elsewhere(demo_out, root):
    """The demo's output as a run from ``root`` leaves it: ``root/nbkit-demo-out/{base,adapter}``, the adapter's
    config naming its base by the relative path the demo was given (``nbkit-demo-out/base``)."""
    out = root / "nbkit-demo-out"
    shutil.copytree(demo_out / "base", out / "base")
    shutil.copytree(demo_out / "adapter", out / "adapter")
    config = out / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "nbkit-demo-out/base"}))
    return out / "adapter"


def test_an_adapter_naming_its_base_relatively_exports_from_another_folder(demo_out, tmp_path, monkeypatch):
    adapter = demo_run_elsewhere(demo_out, tmp_path / "project")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(adapter), "--to", "gguf", "--out", str(tmp_path / "gguf")]) == 0
    gguf_file = tmp_path / "gguf" / "nbkit-demo-out-f16.gguf"
    assert json.loads(gguf_file.with_suffix(".export.json").read_text())["check"]["ok"]


def test_a_missing_relative_base_fails_fast_naming_it_where_it_looked_and_base(no_demo_base_above, demo_out, tmp_path,
                                                                               monkeypatch, capsys):
    adapter = demo_run_elsewhere(demo_out, tmp_path / "project")
    shutil.rmtree(tmp_path / "project" / "nbkit-demo-out" / "base")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(adapter), "--to", "gguf", "--out", str(tmp_path / "gguf")]) == 1
    err = capsys.readouterr().err
    assert "'nbkit-demo-out/base'" in err and "adapter_config.json" in err
    assert str(tmp_path / "nbkit-demo-out" / "base") in err  # the working directory
    assert str(tmp_path / "project" / "nbkit-demo-out" / "base") in err  # beside the adapter's folder
    assert "HF_HUB_OFFLINE is set" in err and "--base <folder or hub id>" in err
    assert "huggingface.co" not in err


def test_a_folder_that_is_neither_fails_with_a_message(tmp_path, capsys):
    assert main([str(tmp_path), "--to", "gguf", "--out", str(tmp_path / "x")]) == 1
    assert "neither adapter_config.json" in capsys.readouterr().err


def test_push_offline_fails_clearly_after_the_files_are_written(demo_out, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main([str(demo_out / "base"), "--to", "gguf", "--out", str(tmp_path), "--no-check", "--push", "me/tiny"])
    assert code == 1
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert list(tmp_path.glob("*.gguf"))


def test_push_names_an_unreachable_hub(tmp_path, monkeypatch):
    from nbkit.export.push import HubOfflineError, push_to_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(HubOfflineError, match="127.0.0.1 is not reachable") as error:
        push_to_hub(tmp_path / "f.txt", "me/repo")
    # the commands it names are huggingface_hub's current CLI (`huggingface-cli` is gone from it)
    assert "huggingface-cli" not in str(error.value)
    assert f"`hf upload --private me/repo {tmp_path / 'f.txt'}`" in str(error.value) and "`hf auth login`" in str(error.value)
    with pytest.raises(FileNotFoundError):
        push_to_hub(tmp_path / "missing", "me/repo")


@pytest.mark.parametrize("template,fmt,stops", [
    ("{{ '<|im_start|>user' }}", "chatml", ["<|im_end|>", "<|im_start|>"]),
    ("{{ '<|start_header_id|>' }}", "llama3", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    ("{{ '<start_of_turn>' }}", "gemma", ["<end_of_turn>"]),
    ("{{ '[INST]' }}", "mistral", ["[INST]", "[/INST]"]),
    ("{{ 'User:' }}", None, []),
])
def test_the_modelfile_translates_known_chat_formats(template, fmt, stops):
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.export.modelfile import FORMATS, modelfile_text

    tok = load_demo_tokenizer()
    tok.chat_template = template
    text, found = modelfile_text("m.gguf", tok)
    assert found == fmt
    assert text.startswith("FROM ./m.gguf\n")
    assert ("TEMPLATE" in text) == (fmt is not None)
    if fmt:
        assert FORMATS[fmt][1] in text
    for stop in ["<|im_end|>", *stops]:  # the tokenizer's eos / end of turn, then the format's markers
        assert f'PARAMETER stop "{stop}"' in text
