"""CPU smoke runs of the trainer-level benchmarks through their public entries (``--tiny``: a tiny fp32 model).

Each path trains on the same data from the same initial weights and LoRA, so at step 1 (before any update) plain
TRL and FastSFT compute the same loss: equal to 1e-4 relative in fp32 (their attention kernels differ). Each run
writes its results file under the exact command line.
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import e2e, packing


def _check_written(path, benchmark: str, argv: list[str], rows: list[dict]) -> None:
    written = json.loads(path.read_text())
    assert written["benchmark"] == benchmark
    assert written["command"] == " ".join(["python", "-m", f"benchmarks.{benchmark}", *argv])
    assert [r["path"] for r in written["figures"]] == [r["path"] for r in rows]
    assert written["notes"] == "CPU smoke run (--tiny)"


def test_e2e_tiny_runs_plain_trl_and_fastsft_to_the_same_first_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sft,fastsft", "--tokens", "256", "--steps", "2", "--warmup", "1",
            "--profile", "fastsft"]
    rows = e2e.main(argv)
    assert [r["path"] for r in rows] == ["sft", "fastsft"] and not [r for r in rows if r.get("error")], rows
    sft, fast = rows
    assert fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)
    assert len(fast["losses"]) == len(sft["losses"]) == 3 and all(r["tokens"] == 256 for r in rows)
    assert "GPU kernel time per step" in fast["profile"] and "profile" not in sft  # the profiled path only
    _check_written(tmp_path / "e2e_tiny_fp32_uncapped_sft+fastsft.json", "e2e", argv, rows)


def test_e2e_each_path_alone_runs_every_path_in_its_own_process_on_one_saved_model(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    model = tmp_path / "model"
    argv = ["--tiny", "--paths", "sft,fastsft", "--tokens", "256", "--steps", "2", "--warmup", "1",
            "--each-path-alone", "--model-dir", str(model)]
    rows = e2e.main(argv)
    assert [(r["path"], r["process"]) for r in rows] == [("sft", 1), ("fastsft", 2)], rows
    assert not [r for r in rows if r.get("error")], rows
    sft, fast = rows
    assert fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)  # the same saved model and data
    assert (model / "config.json").is_file()  # --model-dir: kept for the next run
    _check_written(tmp_path / "out" / "e2e_tiny_fp32_uncapped_sft+fastsft.json", "e2e", argv, rows)


def test_e2e_each_path_alone_names_a_path_whose_process_wrote_nothing(tmp_path, monkeypatch):
    """A path's process that dies before writing (killed for memory, say) leaves an error row, not a gap."""
    import subprocess

    real = subprocess.run

    def second_dies(command, **kwargs):
        if "fastsft" in command:
            return subprocess.CompletedProcess(command, -9)
        return real(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", second_dies)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    argv = ["--tiny", "--paths", "sft,fastsft", "--tokens", "256", "--steps", "1", "--warmup", "1", "--each-path-alone"]
    rows = e2e.main(argv)
    assert [r["path"] for r in rows] == ["sft", "fastsft"]
    assert not rows[0].get("error") and "wrote no row" in rows[1]["error"] and rows[1]["tokens"] == 256, rows


def test_e2e_notebook_recipe_times_whole_optimizer_steps(tmp_path, monkeypatch):
    """batch 2 x 4 accumulation steps, padding-free, unpacked: one timer entry per optimizer step holding its 8
    documents' tokens (not one per micro-step)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--recipe", "notebook", "--paths", "sft,fastsft", "--tokens", "128", "--steps", "2",
            "--warmup", "1"]
    rows = e2e.main(argv)
    assert not [r for r in rows if r.get("error")], rows
    sft, fast = rows
    assert fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)
    for r in rows:
        assert len(r["step_ms_all"]) == len(r["tokens_all"]) == len(r["losses"]) == 3
        assert all(8 * 8 <= t <= 8 * 120 for t in r["tokens_all"])  # 8 documents of 8..120 tokens, no padding
    assert fast["tokens_all"] == sft["tokens_all"] and fast["recipe"] == "notebook"
    _check_written(tmp_path / "e2e_recipe-notebook_tiny_fp32_uncapped_sft+fastsft.json", "e2e", argv, rows)


def test_e2e_a_failed_row_keeps_what_the_trainer_said_of_its_speedups(tmp_path, monkeypatch):
    """A path that raises in train() (an out-of-memory on a capped card) still records the speedups it ran and the
    layer plan's counters, which are what explain the failure; the other paths' rows are kept."""
    from nbkit import FastSFT

    def fails(self, *args, **kwargs):
        raise RuntimeError("out of memory, as on a capped card")

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(FastSFT, "training_step", fails)
    rows = e2e.main(["--tiny", "--paths", "sft,fastsft", "--tokens", "128", "--steps", "2", "--warmup", "1"])
    sft, fast = rows
    assert not sft.get("error") and "out of memory, as on a capped card" in fast["error"]
    assert any(name.startswith("cached_packing") for name in fast["speedups"]), fast


def test_e2e_unsloth_recipe_times_the_whole_run_and_every_step(tmp_path, monkeypatch):
    """Unsloth's notebook recipe: adamw_8bit, no packing, rows cut at --tokens; every step's wall time in order (the
    first 4 on their own), the whole train(), one results file named for the recipe, compute, cap and paths."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--recipe", "unsloth", "--paths", "sft,fastsft", "--tokens", "128", "--steps", "5"]
    rows = e2e.main(argv)
    assert not [r for r in rows if r.get("error")], rows
    sft, fast = rows
    assert fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)
    for r in rows:
        assert r["optim"] == "adamw_8bit" and r["packing"] is False and r["warmup"] == 4
        assert len(r["step_wall_ms_all"]) == len(r["losses"]) == r["steps"] == 5
        assert r["first_steps_ms"] == r["step_wall_ms_all"][:4] and r["step_ms"] == r["step_wall_ms_all"][4]
        assert sum(r["step_wall_ms_all"]) / 1000 <= r["train_s"]
        assert all(8 * 2 <= t <= 8 * 128 for t in r["tokens_all"])  # 8 rows a step, none past the cut
    _check_written(tmp_path / "e2e_recipe-unsloth_tiny_fp32_uncapped_sft+fastsft.json", "e2e", argv, rows)


def test_packing_tiny_runs_sdpa_and_nbkit_to_the_same_first_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sdpa,nbkit", "--tokens", "512", "--steps", "2", "--warmup", "1"]
    rows = packing.main(argv)
    assert [r["path"] for r in rows] == ["sdpa", "nbkit"] and not [r for r in rows if r.get("error")], rows
    sdpa, nbkit = rows
    assert nbkit["loss_first"] == pytest.approx(sdpa["loss_first"], rel=1e-4)
    # packing alone: the ratio is that speedup's own
    assert [s.split("(")[0] for s in nbkit["speedups"]] == ["cached_packing"] and not sdpa["speedups"]
    _check_written(tmp_path / "packing.json", "packing", argv, rows)


def test_e2e_host_profile_reruns_the_path_and_says_where_the_host_time_goes(tmp_path, monkeypatch):
    pytest.importorskip("pyinstrument")
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sft", "--tokens", "256", "--steps", "3", "--warmup", "1",
            "--host-profile", "fastsft"]
    rows = e2e.main(argv)
    assert [r["path"] for r in rows] == ["sft", "fastsft (host-profiled)"], rows
    sft, fast = rows
    assert "host_profile" not in sft and fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)
    owners = fast["host_ms_per_step"]
    # the sampled time is the step's (it runs on the training thread), split among its owners
    assert sum(owners.values()) == pytest.approx(fast["step_ms"], rel=0.5)
    assert owners["torch.autograd"] > 0 and any(o.startswith("nbkit.") for o in owners), owners
    assert "| owner | ms/step | share of the step |" in fast["host_profile"]
    assert "top functions" in fast["host_profile"]


def test_e2e_first_steps_profile_samples_each_of_the_first_steps_on_its_own(tmp_path, monkeypatch):
    """--first-steps-profile: train()'s start and each of the first --warmup steps sampled apart, in order, each
    step's sampled time its own wall time; the row says it was profiled."""
    pytest.importorskip("pyinstrument")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = e2e.main(["--tiny", "--paths", "fastsft", "--tokens", "256", "--steps", "2", "--warmup", "2",
                     "--first-steps-profile"])
    (row,) = rows
    assert row["path"] == "fastsft (first steps host-profiled)" and not row.get("error"), row
    text = row["first_steps_host"]
    heads = re.findall(r"^#### (.+)$", text, re.M)
    assert heads == ["train() before step 1", "step 1", "step 2"], heads
    for step, wall in zip(text.split("#### step ")[1:], row["step_ms_all"]):
        sampled = float(re.search(r"host time sampled per step: ([\d,.]+) ms", step).group(1).replace(",", ""))
        assert sampled == pytest.approx(wall, rel=0.5) and f"(step wall {wall:,.1f} ms)" in step


@pytest.mark.parametrize("path, owner", [
    ("/x/site-packages/torch/optim/adamw.py", "torch.optim"),
    ("/x/site-packages/torch/utils/checkpoint.py", "torch checkpoint"),
    ("/x/site-packages/torch/_tensor.py", "torch (other)"),
    ("/x/site-packages/torch/_inductor/compile_fx.py", "torch.compile"),
    ("/x/site-packages/torch/_dynamo/eval_frame.py", "torch.compile"),
    ("/x/site-packages/triton/compiler/compiler.py", "triton"),
    ("/x/dist-packages/trl/trainer/sft_trainer.py", "trl"),
    ("/x/site-packages/bitsandbytes/autograd/_functions.py", "bitsandbytes"),
    ("/repo/nbkit/ops/lora_linear.py", "nbkit.ops.lora_linear"),
    ("/repo/nbkit/speedups/__init__.py", "nbkit.speedups"),
    ("/venv/site-packages/nbkit/sync_free_loss.py", "nbkit.sync_free_loss"),
    ("/usr/lib/python3.11/threading.py", "python"),
])
def test_host_owner_names_the_package_or_nbkit_module(path, owner):
    from benchmarks.profiling import host_owner

    assert host_owner(path) == owner


def test_moe_rounding_measures_every_path_against_float64(tmp_path, monkeypatch):
    from benchmarks import moe_rounding

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = moe_rounding.main(["--families", "mixtral", "--dtype", "fp32,bf16", "--batches", "4"])
    assert [(r["dtype"], r["path"]) for r in rows] == [(d, p) for d in ("float32", "bfloat16")
                                                      for p in ("grouped_mm", "eager", "nbkit")]
    assert not [r for r in rows if "error" in r], rows
    # float32 is float64 to rounding for every path (a wrong expert path would be far off); bf16 is not
    assert all(r["logits_rel"] < 1e-5 and r["grads_rel"] < 1e-5 for r in rows if r["dtype"] == "float32"), rows
    assert all(1e-4 < r["logits_rel"] < 0.5 for r in rows if r["dtype"] == "bfloat16"), rows
    assert json.loads((tmp_path / "moe_rounding.json").read_text())["benchmark"] == "moe_rounding"


def test_gap_tables_merge_streams_and_name_the_kernels_around_each_gap(tmp_path):
    from benchmarks.profiling import gap_tables

    kernel = {"ph": "X", "cat": "kernel"}
    events = [dict(kernel, name="a", ts=0, dur=10), dict(kernel, name="b", ts=5, dur=10),  # overlapping streams
              dict(kernel, name="gemm<float>", ts=100, dur=50), {"ph": "X", "cat": "gpu_memcpy", "name": "copy",
                                                                 "ts": 160, "dur": 5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]  # the host's: not counted
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = gap_tables(str(trace), steps=1)
    # busy 15 + 50 + 5 us, idle 85 + 10 us over a 165 us window
    assert text.startswith("GPU window 0.2 ms/step: busy 0.1, idle 0.1 (2 gaps a step")
    assert "| 85 | `b` | `gemm<float>` |" in text and "| 10 | `gemm<float>` | `copy` |" in text
    assert "| `gemm` | 0.09 |" in text  # idle before each kernel, templates folded


def test_gap_host_tables_name_the_host_calls_between_the_launches_around_a_gap(tmp_path):
    """A 900 us GPU gap: the kernel after it was launched late; the top-level host calls between the two launches
    (not the ones nested in them, not the ones outside the interval) are named with their durations."""
    from benchmarks.profiling import gap_host_tables

    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **({"args": {"correlation": corr}}
                                                                             if corr is not None else {})}

    events = [x("cuda_runtime", "cudaLaunchKernel", 0, 5, 1), x("kernel", "first", 10, 20, 1),
              x("python_function", "trainer.py(1): training_step", 6, 1000),  # encloses the interval: left out
              x("python_function", "model.py(2): train", 20, 400), x("cpu_op", "aten::empty", 30, 10),  # nested
              x("cpu_op", "aten::item", 500, 300),
              x("cuda_runtime", "cudaLaunchKernel", 900, 5, 2), x("kernel", "second", 930, 20, 2),
              x("cuda_runtime", "cudaLaunchKernel", 905, 5, 3), x("kernel", "third", 960, 20, 3)]  # 10 us: no gap
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = gap_host_tables(str(trace), steps=1)
    assert text.startswith("GPU gaps of 300 us or more over 1 steps: 1")
    assert "| 900 | `second` | model.py(2): train 400; aten::item 300 |" in text, text
    assert "training_step" not in text and "aten::empty" not in text


def test_e2e_gaps_reruns_the_path_with_the_gpu_alone_profiled(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = e2e.main(["--tiny", "--paths", "sft", "--tokens", "256", "--steps", "2", "--warmup", "1",
                     "--gaps", "fastsft"])
    assert [r["path"] for r in rows] == ["sft", "fastsft (GPU-profiled)"], rows
    assert rows[1]["gpu_gaps"] == "no GPU activity in the trace"  # a CPU: nothing on a GPU to find gaps in
