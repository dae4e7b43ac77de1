"""The private members of TRL, transformers, PEFT and bitsandbytes that ``nbkit.trl_seam`` lists are all there in the
installed versions, with the parameters nbkit passes; and nbkit relies on no private member the seam leaves out.

Checked per entry: an importable member imports; a method nbkit calls takes nbkit's arguments under the names nbkit
uses, in order; a method nbkit overrides has nbkit's parameters exactly; an instance attribute of the trainer is set
on a plain ``SFTTrainer`` during a training step; an attribute of a model or config is there on a tiny model with
checkpointing on. Then the other direction: every deep import from those packages in ``nbkit/`` (a module the
package does not export the name from) and every ``._name`` of theirs that ``nbkit/`` reads is in the seam.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from nbkit import trl_seam
from nbkit.trl_seam import MEMBERS, Member, lookup

ROOT = Path(__file__).resolve().parent.parent


def _ids(members):
    return [m.where for m in members]


def _lookup(member: Member):
    """The member; an optional one that this release lacks skips (nbkit keeps its plain path without it)."""
    try:
        return lookup(member.where)
    except ImportError:
        if member.optional:
            pytest.skip(f"{member.where}: not in this release (optional: {member.why})")
        raise


# -- each entry is there ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", [m for m in MEMBERS if m.kind in ("import", "call", "override")],
                         ids=_ids([m for m in MEMBERS if m.kind in ("import", "call", "override")]))
def test_each_importable_member_is_there_with_nbkits_parameters(member: Member):
    obj = _lookup(member)
    if member.kind == "call" and member.params:
        if isinstance(obj, type):  # a dataclass nbkit builds by keyword
            fields = getattr(obj, "__dataclass_fields__", None) or inspect.signature(obj).parameters
            missing = [p for p in member.params if p not in fields]
            assert not missing, f"{member.where} lost {missing}"
            return
        params = list(inspect.signature(obj).parameters.values())
        if params and params[0].name in ("self", "cls") and member.params[0] not in ("self", "cls"):
            params = params[1:]
        if any(p.kind is p.VAR_POSITIONAL for p in params[:1]):  # *params: anything nbkit passes goes
            assert params[0].name == member.params[0], (member.where, params)
            return
        names = [p.name for p in params]
        assert names[: len(member.params)] == list(member.params), (member.where, names)
        later = params[len(member.params):]
        assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in later), \
            f"{member.where} now needs more than nbkit passes: {later}"
    if member.kind == "override":
        from nbkit import FastSFT

        ours = getattr(FastSFT, member.qualname.rpartition(".")[2])
        assert inspect.getmodule(ours).__name__.startswith("nbkit."), f"{member.where} is no longer overridden"
        theirs = [p.name for p in inspect.signature(obj).parameters.values()]
        assert [p.name for p in inspect.signature(ours).parameters.values()] == theirs, member.where


def test_the_seams_imports_resolve_to_the_listed_members():
    for name, where in trl_seam._IMPORTS.items():
        members = [m for m in MEMBERS if m.where == where or m.where.startswith(where + ".")]
        assert members, f"{name}: {where} is not in MEMBERS"
        try:
            found = lookup(where)
        except ImportError:
            assert all(m.optional for m in members), where  # checked (and skipped) per member above
            continue
        assert getattr(trl_seam, name) is found
    with pytest.raises(AttributeError):
        trl_seam.NoSuchName  # noqa: B018


def test_a_member_that_is_gone_fails_the_lookup():
    """Negative control: a renamed method, a missing module."""
    with pytest.raises(ImportError, match="_save_checkpoint_renamed"):
        lookup("transformers.trainer:Trainer._save_checkpoint_renamed")
    with pytest.raises(ImportError):
        lookup("trl.trainer.no_such_module:Thing")


class _Seen(TrainerCallback):
    """The trainer's attributes as they are in the middle of a training step."""

    def __init__(self, trainer):
        self.trainer, self.names = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        self.names = set(vars(self.trainer))


@pytest.fixture(scope="module")
def seen_on_a_plain_trainer(tmp_path_factory):
    from parity import fast_sft
    from trl import SFTTrainer

    trainer = fast_sft(tmp_path_factory.mktemp("plain"), trainer_cls=SFTTrainer, max_steps=1, rows=8)
    seen = _Seen(trainer)
    trainer.add_callback(seen)
    trainer.train()
    return seen.names


@pytest.mark.parametrize("member", [m for m in MEMBERS if m.kind == "trainer"],
                         ids=_ids([m for m in MEMBERS if m.kind == "trainer"]))
def test_each_trainer_attribute_is_set_during_training(member: Member, seen_on_a_plain_trainer):
    assert member.qualname.rpartition(".")[2] in seen_on_a_plain_trainer, f"{member.where} is no longer set"


@pytest.fixture(scope="module")
def tiny_checkpointed():
    from parity import tiny_lm

    from nbkit.compat import enable_activation_checkpointing

    model = tiny_lm("qwen3")
    enable_activation_checkpointing(model)
    return model


@pytest.mark.parametrize("member", [m for m in MEMBERS if m.kind == "model"],
                         ids=_ids([m for m in MEMBERS if m.kind == "model"]))
def test_each_model_attribute_is_there(member: Member, tiny_checkpointed):
    owner_path, _, name = member.where.rpartition(".")
    owner = lookup(owner_path)
    from transformers import PretrainedConfig, PreTrainedModel

    if issubclass(owner, PretrainedConfig):
        target = tiny_checkpointed.config
    elif issubclass(owner, PreTrainedModel):
        target = tiny_checkpointed
    else:
        target = next(m for m in tiny_checkpointed.modules() if isinstance(m, owner))
    if member.optional and not hasattr(target, name):
        pytest.skip(f"{member.where}: not in this release (optional: {member.why})")
    assert hasattr(target, name) or name in vars(target), f"{member.where} is not there"
    if name == "_gradient_checkpointing_func":
        assert callable(getattr(target, name))


def test_every_member_has_a_check():
    assert {m.kind for m in MEMBERS} <= {"import", "call", "override", "trainer", "model"}
    for m in MEMBERS:
        assert m.why and m.users and ":" in m.where, m
        for user in m.users:
            path = ROOT / "nbkit" / Path(*user.split("."))
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), (m.where, user)


# -- nothing left out -------------------------------------------------------------------------------------------------
def _nbkit_sources():
    return sorted((ROOT / "nbkit").rglob("*.py"))


def _exported(package: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(package), name)
    except Exception:
        return False


# imported from submodules, and public: named in the libraries' documentation
DOCUMENTED = {
    "transformers.generation.streamers:BaseStreamer",  # the streamer interface generate() takes
    "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS",  # the attention registry (AttentionInterface's docs)
    "transformers.utils:is_torch_bf16_gpu_available", "transformers.utils:is_sagemaker_mp_enabled",
    "bitsandbytes.nn:Linear4bit", "bitsandbytes.nn:Params4bit", "bitsandbytes.functional:dequantize_4bit",
}


def _unlisted_deep_imports(members, sources=None) -> list[str]:
    listed = {m.where for m in members} | DOCUMENTED
    missing = []
    for path in sources or _nbkit_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            top = node.module.split(".")[0]
            if top not in ("trl", "transformers", "peft", "bitsandbytes") or node.module == top:
                continue
            for alias in node.names:
                where = f"{node.module}:{alias.name}"
                known = where in listed or any(w.startswith(where + ".") for w in listed)
                if not known and (alias.name.startswith("_") or not _exported(top, alias.name)):
                    missing.append(f"{path.name}: {where}")
    return missing


def test_every_deep_import_from_the_libraries_is_in_the_seam():
    """A name imported from a submodule of TRL, transformers, PEFT or bitsandbytes that the package itself does not
    export (or an underscore name) is private to that package: it is listed in the seam."""
    assert _unlisted_deep_imports(MEMBERS) == []


def _unlisted_underscore_names(members) -> list[str]:
    from transformers import PretrainedConfig, PreTrainedModel, Trainer
    from trl import SFTTrainer
    from trl.trainer import utils as trl_utils

    theirs = set()
    for owner in (SFTTrainer, Trainer, PreTrainedModel, PretrainedConfig, trl_utils):
        theirs |= {n for n in dir(owner) if n.startswith("_") and not n.startswith("__")}
    # set on instances, so not in dir() of the classes
    theirs |= {"_tr_loss", "_globalstep_last_logged", "_metrics", "_total_train_tokens", "_tp_size",
               "_gradient_checkpointing_func", "_experts_implementation_internal", "_tied_weights_keys"}
    theirs -= set(dir(torch.Tensor)) | set(dir(torch.nn.Module))  # torch's own (p._version, m._parameters)
    listed = {m.qualname.rpartition(".")[2] for m in members}
    pattern = re.compile(r"\w\.(_[a-zA-Z]\w*)|[\"'](_[a-zA-Z]\w*)[\"']")
    missing = set()
    for path in _nbkit_sources():
        for match in pattern.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            if name in theirs and name not in listed:
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    return sorted(missing)


def test_the_libraries_underscore_names_nbkit_reads_are_in_the_seam():
    """``x._name`` (or ``"_name"`` given to getattr / a ledger) in nbkit, where ``_name`` belongs to TRL's or
    transformers' trainer, a transformers model or config, or TRL's utils, is listed in the seam."""
    assert _unlisted_underscore_names(MEMBERS) == []


def test_a_private_member_left_out_of_the_seam_is_caught(tmp_path):
    """Negative controls: an attribute dropped from the seam, an unlisted deep import, are noticed; a public import
    from a submodule of a name the package exports is not."""
    assert any("_tr_loss" in line for line in
               _unlisted_underscore_names([m for m in MEMBERS if not m.where.endswith("._tr_loss")]))
    source = tmp_path / "user.py"
    source.write_text("from trl.trainer.sft_trainer import DataCollatorForLanguageModeling, SFTTrainer\n"
                      "from transformers.trainer import _is_peft_model\n")
    assert _unlisted_deep_imports(MEMBERS, [source]) == ["user.py: transformers.trainer:_is_peft_model"]
    assert _unlisted_deep_imports([], [source])[0] == "user.py: trl.trainer.sft_trainer:DataCollatorForLanguageModeling"


def test_a_changed_signature_fails_the_member_check(monkeypatch):
    """Negative controls: a called method that takes other parameters, an overridden one with one more."""
    from transformers import Trainer
    from trl import SFTTrainer

    def prepare(self, dataset, processing_class, args, formatting_func, dataset_name, packing=False):
        raise AssertionError("never called")

    def save(self, model, trial, metrics):
        raise AssertionError("never called")

    by_where = {m.where: m for m in MEMBERS}
    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", prepare)
    with pytest.raises(AssertionError, match="_prepare_dataset"):
        test_each_importable_member_is_there_with_nbkits_parameters(by_where[
            "trl.trainer.sft_trainer:SFTTrainer._prepare_dataset"])
    monkeypatch.setattr(Trainer, "_save_checkpoint", save)
    with pytest.raises(AssertionError, match="_save_checkpoint"):
        test_each_importable_member_is_there_with_nbkits_parameters(by_where["transformers.trainer:Trainer._save_checkpoint"])


def test_the_fingerprint_ignores_layout_and_sees_code():
    """Comments, blank lines, indentation and the docstring leave a fingerprint as it is; one changed token does not."""
    from nbkit.trl_seam import source_fingerprint

    plain = "def f(x):\n    y = x + 1\n    return y\n"
    laid_out = '    def f(x):\n        """Adds one."""\n\n        # the sum\n        y = x + 1\n        return y\n'
    assert source_fingerprint(plain) == source_fingerprint(laid_out)
    assert source_fingerprint(plain) != source_fingerprint(plain.replace("+ 1", "+ 2"))
