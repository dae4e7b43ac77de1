"""FastSFT on several processes through accelerate, on CPUs (gloo): what multi-GPU users rely on, minus the GPUs.

1. ``accelerate launch`` with the DDP config of docs/multi_gpu.md, 2 processes x 2 packed rows, trains exactly
   like 1 process x 4 rows (same global batch, same data order): per-step losses and gradient norms equal to
   ``RTOL`` relative, trainable weights to ``WEIGHT_ATOL`` after 4 AdamW steps, the two replicas bit-identical.
   Control: the same 2-process run with ``average_tokens_across_devices=False`` (each rank normalises by its own
   token count) must miss by more than 10 x ``RTOL``, so the tolerance can see a wrong loss normalisation.
2. Each rank packs its own batch: its forwards carry their own ``cu_seqlens`` (built by the collator, never in the
   forward), consistent with its own tokens, and the two ranks' batches laid end to end are the 1-process batch.
3. Every speedup attaches and runs on every rank: packed attention, MoE routing, offloaded checkpointing.
4. The dashboard, attached on every rank as ``FastSFT`` attaches it: TRL's ``num_tokens`` on rank 0 counts both
   ranks' tokens, so rank 0's tokens/s is the job's (shown as "all 2 ranks", not multiplied again); the
   ``nbkit.distributed.RankMemoryCallback`` that ``attach`` adds gathers every rank's memory at each log, on every
   rank, and rank 0's summary shows those rows; rank 1 shows nothing. One process gets no such callback.
5. FSDP2 (torch ``fully_shard``; accelerate 1.15 does not shard on CPUs) with the three speedups, launched by
   ``accelerate.notebook_launcher`` as a notebook would: each rank's loss equals the unsharded plain model's on
   that rank's batch, and the averaged sharded gradients equal the plain model's to ``FSDP_GRAD_RTOL``.
6. The FSDP2 config of docs/multi_gpu.md is what accelerate hands a GPU run (version 2, per-layer wrap, ...).

Measured here (fp32): losses and gradient norms within 1.2e-7 relative, weights within 4e-6, FSDP2 gradients
within 2.3e-6 of each tensor's largest entry; the control misses by 8.7e-5 at step 1 and 5e-4 at step 2.
About 70 s on 2 CPU cores: four launches of two processes, each importing torch/transformers/TRL.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_train.py"
DOCS = ROOT / "docs" / "multi_gpu.md"
STEPS = 4
RTOL = 1e-5  # losses and gradient norms, 2 processes vs 1
WEIGHT_ATOL = 1e-4  # trainable weights after STEPS AdamW steps (AdamW amplifies rounding of near-zero gradients)
FSDP_GRAD_RTOL = 2e-5  # of each tensor's largest entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _load(folder: Path, run: str, world: int) -> list[dict]:
    return [json.loads((folder / f"{run}-rank{r}.json").read_text()) for r in range(world)]


def _train_logs(record: dict) -> list[dict]:
    return [h for h in record["log_history"] if "loss" in h]


def _doc_lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def test_rank_memory_without_a_process_group():
    from nbkit.distributed import RankMemoryCallback, gather_rank_memory

    (mine,) = gather_rank_memory("cpu")
    assert mine.rank == 0 and mine.allocated is None and mine.host_rss > 0
    cb = RankMemoryCallback()
    cb.on_log(None, None, None, logs={"loss": 1.0})
    assert cb.gathers == 1 and [m.rank for m in cb.latest] == [0]


@pytest.fixture(scope="module")
def doc_configs(tmp_path_factory) -> dict[str, Path]:
    """The accelerate configs of docs/multi_gpu.md (each a yaml block whose first line names the file), on disk."""
    folder = tmp_path_factory.mktemp("configs")
    found = {}
    for name, body in re.findall(r"```yaml\n# (\S+)\n(.*?)```", DOCS.read_text(), re.S):
        (folder / name).write_text(body)
        found[name] = folder / name
    assert {"accelerate_ddp_2gpu.yaml", "accelerate_fsdp2_2gpu.yaml"} <= found.keys(), sorted(found)
    return found


def _launch(config: Path, *args: str) -> str:
    """``accelerate launch --config_file config`` (on CPUs, the script's ``--cpu`` makes each process use gloo)."""
    return _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                 "--main_process_port", str(_free_port()), str(SCRIPT), *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, doc_configs):
    """The 1-process reference and the 2-process launch with the documented DDP config (control run included)."""
    base = tmp_path_factory.mktemp("dist")
    common = ["--cpu", "--steps", str(STEPS)]
    _run([sys.executable, str(SCRIPT), *common, "--out", str(base / "one"), "--batch", "4"])
    _launch(doc_configs["accelerate_ddp_2gpu.yaml"], *common, "--out", str(base / "two"), "--batch", "2", "--control")
    return {
        "one": _load(base / "one", "main", 1)[0],
        "two": _load(base / "two", "main", 2),
        "noavg": _load(base / "two", "noavg", 2),
        "weights_one": torch.load(base / "one" / "main-rank0.pt"),
        "weights_two": [torch.load(base / "two" / f"main-rank{r}.pt") for r in range(2)],
    }


@pytest.mark.slow
def test_two_processes_train_like_one(runs):
    one, two = runs["one"], runs["two"]
    assert one["world_size"] == 1
    for r, rec in enumerate(two):
        assert (rec["rank"], rec["world_size"], rec["backend"]) == (r, 2, "gloo")
        assert rec["distributed_type"].endswith("MULTI_CPU") and rec["wrapper"] == "DistributedDataParallel"
        assert rec["average_tokens_across_devices"] is True
    ref, got = _train_logs(one), _train_logs(two[0])
    assert len(ref) == len(got) == STEPS
    assert _train_logs(two[1]) == got  # every rank logs the job's numbers
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([h[key] for h in got], dtype=torch.float64),
                                   torch.tensor([h[key] for h in ref], dtype=torch.float64), rtol=RTOL, atol=0)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.2  # it trained

    w1, (w2a, w2b) = runs["weights_one"], runs["weights_two"]
    assert w1.keys() == w2a.keys() == w2b.keys() and len(w1) > 0
    for name in w1:
        assert torch.equal(w2a[name], w2b[name]), f"DDP replicas diverged at {name}"
        torch.testing.assert_close(w2a[name], w1[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow
def test_control_without_token_averaging_misses(runs):
    ref, noavg = _train_logs(runs["one"]), _train_logs(runs["noavg"][0])
    assert runs["noavg"][0]["average_tokens_across_devices"] is False
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(noavg, ref))
    assert worst > 10 * RTOL, f"the control matched the reference to {worst:.1e}: RTOL cannot tell"


@pytest.mark.slow
def test_packed_metadata_is_per_rank(runs):
    one, two = runs["one"], runs["two"]
    ref_fw = one["forwards"]
    assert len(ref_fw) == STEPS and all(len(rec["forwards"]) == STEPS for rec in two)
    for step in range(STEPS):
        parts = [rec["forwards"][step] for rec in two]
        for fw in parts:
            cu, n = fw["cu_seqlens"], len(fw["input_ids"])
            assert cu is not None, "the forward ran without nbkit's packed metadata"
            assert cu[0] == 0 and cu[-1] == n, (cu, n)  # this rank's own tokens, not the global batch
            assert cu[:-1] == fw["starts"]  # documents start where this rank's position ids restart
        assert parts[0]["input_ids"] != parts[1]["input_ids"]
        assert parts[0]["input_ids"] + parts[1]["input_ids"] == ref_fw[step]["input_ids"]
        assert (_doc_lengths(parts[0]["cu_seqlens"]) + _doc_lengths(parts[1]["cu_seqlens"])
                == _doc_lengths(ref_fw[step]["cu_seqlens"]))


@pytest.mark.slow
def test_speedups_attach_and_run_on_every_rank(runs):
    one, two = runs["one"], runs["two"]
    expected = ["cached_packing(sdpa)", "fast_moe_routing", "fused_lora", "offload_checkpointing"]
    # sync_free_metrics mirrors TRL's loss on one process only: the two-process ranks keep TRL's own. It is of the
    # trainer stage, attached after the model stage's decoder-layer runner (whose offload mode is listed by name)
    assert one["attached"] == expected + ["sync_free_metrics"]
    for rec in two:
        assert rec["attached"] == expected
        by_name = {s["name"]: s for s in rec["speedups"]}
        packing = by_name["cached_packing"]
        assert (packing["forwards"], packing["metadata_builds"], packing["plain_forwards"]) == (STEPS, 0, 0)
        stats = by_name["offload_checkpointing"]["stats"]
        assert stats["packs"] == stats["unpacks"] == STEPS * 4  # 4 checkpointed layers per step, this rank's
        assert stats["host_bytes"] > 0
        assert rec["expert_calls"] == one["expert_calls"] == {"nbkit(loop)": STEPS * 4 * 2}  # forward + recompute


@pytest.mark.slow
def test_dashboard_sees_all_ranks(runs):
    two = runs["two"]
    tokens_per_step = [sum(len(rec["forwards"][s]["input_ids"]) for rec in two) for s in range(STEPS)]
    logged = [h["num_tokens"] for h in _train_logs(two[0])]
    assert logged == [float(sum(tokens_per_step[: s + 1])) for s in range(STEPS)]  # both ranks' tokens
    for rec in two:
        assert rec["rank_memory_gathers"] == STEPS + 1  # each step's log and the end-of-training log
        assert rec["rank_memory_from_dashboard"] and rec["rank_memory_callbacks"] == 1  # attach wired it, once
        mem = rec["rank_memory"]
        assert [m["rank"] for m in mem] == [0, 1]
        assert all(m["host_rss"] and m["host_rss"] > 0 and m["allocated"] is None for m in mem)  # CPU: no VRAM
    assert two[0]["rank_memory"] == two[1]["rank_memory"]  # an all-gather: every rank holds every rank's row

    board = two[0]["dashboard"]  # rank 0's end-of-run summary
    assert board["step"] == STEPS and board["world_size"] == 2
    assert board["tokens"] == logged[-1] == sum(tokens_per_step)  # both ranks' tokens, counted once
    assert board["ranks"] == two[0]["rank_memory"]  # the last gather's rows
    text = two[0]["dashboard_text"]
    assert f"[nbkit] training finished: {STEPS}/{STEPS} steps" in text and "tok/s mean, all 2 ranks" in text
    assert "  rank 0: no CUDA, RSS " in text and "  rank 1: no CUDA, RSS " in text
    assert "| RSS r0 " in text  # the live line: every rank's resident set
    assert two[1]["dashboard"] is None and two[1]["dashboard_text"] == ""  # only rank 0 shows anything
    one = runs["one"]
    assert not one["rank_memory_from_dashboard"] and one["dashboard"]["world_size"] == 1
    assert one["dashboard"]["ranks"] == [] and "rank 0:" not in one["dashboard_text"]


@pytest.mark.slow
def test_fsdp2_with_speedups_via_notebook_launcher(tmp_path):
    out = tmp_path / "fsdp2"
    argv = ["--out", str(out), "--batch", "2", "--cpu", "--fsdp2-direct"]
    code = (
        "import sys; sys.path.insert(0, 'tests'); import dist_train; from accelerate import notebook_launcher; "
        "assert 'bitsandbytes' not in sys.modules, 'the parent imported bitsandbytes: notebook_launcher refuses'; "
        f"notebook_launcher(dist_train.main, args=({argv!r},), num_processes=2, use_port='{_free_port()}')"
    )
    _run([sys.executable, "-c", code])
    recs = _load(out, "fsdp2", 2)
    for r, rec in enumerate(recs):
        assert (rec["rank"], rec["world_size"], rec["backend"]) == (r, 2, "gloo")
        assert rec["param_types"] == ["DTensor"]  # every parameter sharded
        assert rec["attached"] == ["cached_packing", "fast_moe_routing", "offload_checkpointing"]
        by_name = {s["name"]: s for s in rec["speedups"]}
        assert (by_name["cached_packing"]["forwards"], by_name["cached_packing"]["metadata_builds"]) == (1, 0)
        offload = by_name["offload_checkpointing"]["stats"]
        assert offload["packs"] == offload["unpacks"] == 4  # 4 checkpointed layers, one forward
        assert rec["expert_calls"] == {"nbkit(loop)": 8}
        (fw,) = rec["forwards"]
        assert fw["cu_seqlens"][0] == 0 and fw["cu_seqlens"][-1] == len(fw["input_ids"])
        assert fw["cu_seqlens"][:-1] == fw["starts"]
        assert rec["loss"] == pytest.approx(rec["ref_losses"][r], rel=1e-6)

        saved = torch.load(out / f"fsdp2-rank{r}.pt")
        grads, ref = saved["grads"], saved["ref_grads"]
        assert grads.keys() == ref.keys() and len(grads) > 0
        for name in grads:
            scale = ref[name].abs().max().item()
            assert scale > 0, name
            err = (grads[name] - ref[name]).abs().max().item()
            assert err <= FSDP_GRAD_RTOL * scale, f"{name}: {err:.2e} vs {scale:.2e}"
    assert recs[0]["forwards"][0]["input_ids"] != recs[1]["forwards"][0]["input_ids"]
    assert recs[0]["ref_losses"] == recs[1]["ref_losses"]


@pytest.mark.slow
def test_documented_fsdp2_config_is_what_accelerate_reads(doc_configs, tmp_path):
    _launch(doc_configs["accelerate_fsdp2_2gpu.yaml"], "--out", str(tmp_path), "--batch", "1", "--fsdp-plugin")
    recs = [json.loads((tmp_path / f"plugin-rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(recs):
        assert (rec["rank"], rec["world_size"], rec["use_fsdp"]) == (r, 2, "true")
        assert rec["fsdp_version"] == 2 and rec["reshard_after_forward"] is True
        assert rec["auto_wrap_policy"] == "transformer_auto_wrap_policy"
        assert rec["state_dict_type"].endswith("FULL_STATE_DICT")
        assert rec["activation_checkpointing"] is False  # transformers' checkpointing, so nbkit's offload attaches
        assert rec["offload_params"] != "CPUOffloadPolicy"


# --------------------------------------------------------------------------------------------------------------------
# 2 GPUs (skipped unless 2 CUDA devices are visible): the same proof in bf16 with NCCL, DDP and FSDP2 through the
# documented configs. Tolerances are not measured yet (no 2-GPU machine so far): bf16 autocast on 1 vs 2 GPUs sums
# in another order (DDP), and FSDP2 also computes with bf16 parameter copies, hence the looser FSDP2 bound.
GPU_DDP_RTOL = 5e-3
GPU_FSDP_RTOL = 2e-2


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_train_like_one(doc_configs, tmp_path):
    common = ["--steps", str(STEPS), "--bf16"]
    _run([sys.executable, str(SCRIPT), *common, "--out", str(tmp_path / "one"), "--batch", "4"])
    _launch(doc_configs["accelerate_ddp_2gpu.yaml"], *common, "--out", str(tmp_path / "ddp"), "--batch", "2")
    _launch(doc_configs["accelerate_fsdp2_2gpu.yaml"], *common, "--out", str(tmp_path / "fsdp"), "--batch", "2")
    one = _load(tmp_path / "one", "main", 1)[0]
    ref = torch.tensor([h["loss"] for h in _train_logs(one)], dtype=torch.float64)
    assert not one["attached"][0].endswith("(sdpa)") or torch.cuda.get_device_capability() < (8, 0)
    for run, rtol, wrapper in (("ddp", GPU_DDP_RTOL, "DistributedDataParallel"), ("fsdp", GPU_FSDP_RTOL, None)):
        recs = _load(tmp_path / run, "main", 2)
        for r, rec in enumerate(recs):
            assert (rec["rank"], rec["world_size"], rec["backend"]) == (r, 2, "nccl")
            assert rec["device"] == f"cuda:{r}"
            assert wrapper is None or rec["wrapper"] == wrapper
            assert rec["attached"] == one["attached"], (run, rec["attached"])
            assert [m["rank"] for m in rec["rank_memory"]] == [0, 1]
            assert all(m["peak"] and m["peak"] > 0 for m in rec["rank_memory"])
            assert rec["rank_memory_from_dashboard"]
        board = recs[0]["dashboard"]  # rank 0 shows each GPU's peak
        assert board["ranks"] == recs[0]["rank_memory"] and all(m["total"] > 0 for m in board["ranks"])
        assert "VRAM alloc/peak r0 " in recs[0]["dashboard_text"] and " r1 " in recs[0]["dashboard_text"]
        got = torch.tensor([h["loss"] for h in _train_logs(recs[0])], dtype=torch.float64)
        torch.testing.assert_close(got, ref, rtol=rtol, atol=0, msg=run)
        print(run, "peak bytes per GPU:", [m["peak"] for m in recs[0]["rank_memory"]])
