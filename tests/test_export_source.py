"""``nbkit.export.source.resolve_base``: where the base model an adapter names is found -- a relative folder against
the working directory and the adapter's folders, a Hub id passed on unchanged, and a fast, clear failure when it is
neither here nor reachable. Only folders and a fake Hub cache: nothing is downloaded."""

from __future__ import annotations

import pytest

from nbkit.export.source import BaseModelNotFoundError, describe, resolve_base


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def adapter_folder(path, base):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(f'{{"base_model_name_or_path": "{base}"}}')
    return path


def test_a_relative_base_is_found_above_the_adapter_from_another_working_directory(tmp_path, monkeypatch):
    base = model_folder(tmp_path / "project" / "nbkit-demo-out" / "base")
    adapter = adapter_folder(tmp_path / "project" / "nbkit-demo-out" / "adapter", "nbkit-demo-out/base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert describe(adapter).base == str(base)


def test_a_relative_base_in_the_working_directory_wins(tmp_path, monkeypatch):
    model_folder(tmp_path / "project" / "nbkit-demo-out" / "base")
    here = model_folder(tmp_path / "here" / "nbkit-demo-out" / "base")
    adapter = adapter_folder(tmp_path / "project" / "nbkit-demo-out" / "adapter", "nbkit-demo-out/base")
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_base("nbkit-demo-out/base", adapter) == str(here)


def test_a_hub_id_that_is_no_local_folder_goes_on_unchanged_when_the_hub_is_reachable(tmp_path, monkeypatch):
    import nbkit.export.source as source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(source, "hub_reachable", lambda: None)
    assert resolve_base("Qwen/Qwen3-14B", tmp_path) == "Qwen/Qwen3-14B"


def test_offline_a_hub_id_the_cache_holds_goes_on_unchanged(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "cache" / "models--Qwen--Qwen3-14B" / "snapshots" / ("0" * 40)
    model_folder(snapshot)
    (tmp_path / "cache" / "models--Qwen--Qwen3-14B" / "refs").mkdir()
    (tmp_path / "cache" / "models--Qwen--Qwen3-14B" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_base("Qwen/Qwen3-14B", tmp_path) == "Qwen/Qwen3-14B"


def test_an_unreachable_hub_fails_fast_naming_the_base_the_places_and_base(no_demo_base_above, tmp_path, monkeypatch):
    adapter = adapter_folder(tmp_path / "run" / "adapter", "nbkit-demo-out/base")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(BaseModelNotFoundError) as caught:
        describe(adapter)
    message = str(caught.value)
    assert f"{adapter / 'adapter_config.json'} records the base model 'nbkit-demo-out/base'" in message
    assert str(tmp_path / "nbkit-demo-out" / "base") in message and str(tmp_path / "run" / "nbkit-demo-out") in message
    assert "127.0.0.1 is not reachable" in message and "--base <folder or hub id>" in message


def test_a_base_that_can_only_be_a_path_fails_without_asking_the_hub(tmp_path, monkeypatch):
    import nbkit.export.source as source

    adapter = adapter_folder(tmp_path / "adapter", "../gone/base")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(source, "hub_reachable", lambda: pytest.fail("the Hub was asked about a path"))
    with pytest.raises(BaseModelNotFoundError, match=r"'\.\./gone/base'.*not a Hub id.*--base <folder or hub id>"):
        describe(adapter)


def test_a_base_given_on_the_command_line_is_read_from_the_working_directory(tmp_path, monkeypatch):
    base = model_folder(tmp_path / "models" / "base")
    adapter = adapter_folder(tmp_path / "adapter", "somewhere/else")
    monkeypatch.chdir(tmp_path)
    assert describe(adapter, "models/base").base == str(base)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BaseModelNotFoundError, match=r"the --base given, 'models/typo', .*--base <folder or hub"):
        describe(adapter, "models/typo")
