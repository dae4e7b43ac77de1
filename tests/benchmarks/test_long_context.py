"""CPU tests of the long-context benchmark (``python -m benchmarks.long_context``): the search logic on synthetic
memory lines (it brackets a fake limit to its resolution, in few tries when the prior is right, also when the
allocator fails before the line says; it stops at its time budget), the step-time model, the crash records of the
worker, the summary rows, and the public entry end to end on a tiny model (``--tiny``: a fake OOM limit on the CPU).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import long_context as lc
from benchmarks import long_context_search as lcs
from benchmarks.offload_longest import predict_max
from nbkit.memory import GiB, MiB

FIXED_GIB, MIB_PER_TOKEN = 6.5, 0.58  # the 8B sft prior


def peak(tokens: int, mib: float = MIB_PER_TOKEN, quad: float = 0.0) -> float:
    return FIXED_GIB + tokens * mib * MiB / GiB + quad * tokens * tokens


def fake_runner(budget: str, fits, peak_of, clock: list | None = None, seconds=lambda t: 1.0):
    """A try on a fake GPU: ok when ``fits(tokens)``; its peak from ``peak_of``; ``clock`` advanced by its time."""
    def run_one(t: int) -> dict:
        ok = fits(t)
        if clock is not None:
            clock[0] += seconds(t)
        return dict(event="try", kind="search", path="p", budget=budget, budget_gib=12.0, tokens=t,
                    outcome="ok" if ok else "oom", peak_gib=peak_of(t) if ok else 0.0, host_short=0,
                    step_s=seconds(t) if ok else None, wall_s=seconds(t))
    return run_one


def search(run_one, cap, prior, res, tries=None, **kw):
    tries = [] if tries is None else tries
    kw.setdefault("deadline", float("inf"))
    kw.setdefault("clock", lambda: 0.0)
    kw.setdefault("eta", lambda t: None)
    stop = lcs.run_search(run_one, tries, "12 GiB", cap, prior=prior, res=res, **kw)
    return stop, tries


def limit_of(cap: float, mib: float = MIB_PER_TOKEN) -> int:
    return int((cap - FIXED_GIB) * GiB / (mib * MiB))


def check_bracket(tries: list[dict], limit: int, res: int) -> tuple[int, int]:
    lo, hi = lcs.bracket(tries)
    assert lo <= limit < hi and hi - lo <= res, (lo, hi, limit, [(t["tokens"], t["outcome"]) for t in tries])
    return lo, hi


def test_resolution_is_a_sixteenth_of_the_limit_in_powers_of_two():
    assert lcs.resolution(9_500, 1024) == 1024  # 593 rounds down to 512: the floor wins
    assert lcs.resolution(300_000, 1024) == 16384  # 18,750 -> 16,384
    assert lcs.resolution(128, 32) == 32 and lcs.resolution(0, 32) == 32


def test_the_warm_row_decides_offloading_as_the_long_row_does():
    # 8B: 'auto' offload needs one layer input of 16 MiB = 2,048 tokens x 4096 x 2 B, decided at the first step
    auto = -(-lc.OFFLOAD_MIN_BYTES // (4096 * 2))
    assert auto == 2048
    assert lcs.warm_length(32768, 256, auto) == 2048  # long enough to switch offloading on, as the long row does
    assert lcs.warm_length(1500, 256, auto) == 1500  # never longer than the long row
    assert lcs.warm_length(128, 256, 0) == 64 and lcs.warm_length(4096, 256, 0) == 256  # off CUDA: no decision


def test_priors_follow_the_switches():
    assert lcs.prior_key("sft") == "sft" and lcs.prior_key("sft_full_logits") == "sft_full_logits"
    assert lcs.prior_key("fastsft") == "fastsft_tiled"  # tiled_mlp='auto' tiles near the limit
    assert lcs.prior_key("fastsft[tiled_mlp=True]") == "fastsft_tiled"
    assert lcs.prior_key("fastsft[tiled_mlp=True;offload_checkpointing=False]") == "fastsft_tiled_no_offload"
    assert lcs.prior_key("fastsft[tiled_mlp=False]") == "fastsft"
    tokens, fixed, slope = lcs.prior_line("8b", "sft")
    assert (tokens, fixed) == (0, 6.5) and slope == pytest.approx(0.58 / 1024)
    assert lcs.prior_line("tiny", "sft") is None
    assert lcs.offloaded("fastsft", cuda=True) and not lcs.offloaded("fastsft[offload_checkpointing=False]", True)
    assert not lcs.offloaded("sft", cuda=True) and not lcs.offloaded("fastsft", cuda=False)


def test_a_right_prior_brackets_the_limit_in_two_tries():
    cap = 12.0
    limit = limit_of(cap)
    res = lcs.resolution(limit, 1024)
    stop, tries = search(fake_runner("12 GiB", lambda t: t <= limit, peak), cap,
                         lcs.prior_line("8b", "sft"), res)
    assert stop == "converged"
    check_bracket(tries, limit, res)
    # just past the predicted limit (fails), then just under it (fits)
    assert [t["outcome"] for t in tries] == ["oom", "ok"]


def test_a_wrong_prior_is_corrected_by_the_measured_line():
    cap, true_mib = 24.0, 0.45  # the prior says 0.58 MiB/token: it predicts 30.9K where 39.8K fit
    limit = limit_of(cap, true_mib)
    res = lcs.resolution(30_000, 1024)
    stop, tries = search(fake_runner("12 GiB", lambda t: t <= limit, lambda t: peak(t, true_mib)), cap,
                         lcs.prior_line("8b", "sft"), res)
    assert stop == "converged" and len(tries) <= 5
    check_bracket(tries, limit, res)


def test_an_allocator_that_fails_before_the_line_still_brackets_its_limit():
    # fragmentation: the real limit is where the peak reaches 93% of the cap, and the line bends upwards
    cap, quad = 40.0, 1e-11
    fits = lambda t: peak(t, quad=quad) <= 0.93 * cap
    limit = max(t for t in range(1, 80_000) if fits(t))
    res = lcs.resolution(limit, 1024)
    stop, tries = search(fake_runner("12 GiB", fits, lambda t: peak(t, quad=quad)), cap,
                         lcs.prior_line("8b", "sft"), res)
    assert stop == "converged" and len(tries) <= 8
    check_bracket(tries, limit, res)


def test_without_a_prediction_it_doubles_then_bisects():
    # the CPU smoke run: no GPU budget, so no peak line; the fake OOM limit alone
    stop, tries = search(fake_runner("12 GiB", lambda t: t <= 300, lambda t: 0.0), None, None, 32,
                         start_tokens=128)
    assert stop == "converged"
    assert [t["tokens"] for t in tries] == [128, 256, 512, 384, 320, 288]
    check_bracket(tries, 300, 32)


def test_fits_at_other_budgets_narrow_the_bracket():
    # a fit at a smaller budget is a fit here; a failure at a larger one a failure here
    t, stop = lcs.next_length([], [], None, None, 1024, implied_lo=16_384, implied_hi=20_480)
    assert 16_384 < t < 20_480 and stop == ""
    t, stop = lcs.next_length([], [], None, None, 1024, implied_lo=16_384, implied_hi=17_408)
    assert t is None and stop == "converged"
    here = [dict(tokens=8192, outcome="oom"), dict(tokens=9216, outcome="ok")]
    t, stop = lcs.next_length(here, [], None, None, 1024)
    assert t is None and stop.startswith("not monotone")
    # a try cut at the time budget is no failure: the length is still open
    assert lcs.bracket([dict(tokens=8192, outcome="ok"), dict(tokens=16384, outcome="time-cap")]) == (8192, None)


def test_max_tokens_is_tried_and_then_stops_the_search():
    stop, tries = search(fake_runner("12 GiB", lambda t: True, lambda t: 0.0), None, None, 32, start_tokens=128,
                         max_tokens=1000)
    assert [t["tokens"] for t in tries] == [128, 256, 512, 1000] and stop == "--max-tokens 1,000"


def test_the_search_stops_at_its_time_budget():
    clock = [0.0]
    step = lambda t: 2.0 + t / 1000  # seconds of a try: 2 s of trainer set-up, then 1 ms a token
    limit = limit_of(80.0)  # ~130K tokens: more tries than the budget allows
    run_one = fake_runner("80 GiB", lambda t: t <= limit, peak, clock, lambda t: step(t))
    tries: list[dict] = []
    earlier = [(1000, 1.0), (2000, 2.0)]  # step times measured before this search (the timing tries)

    def eta(t: int):
        pts = earlier + [(x["tokens"], x["step_s"] - 2.0) for x in tries if x.get("step_s")]
        return lcs.eta_s(pts, t, 2.0)

    stop = lcs.run_search(run_one, tries, "80 GiB", 80.0, prior=(0, FIXED_GIB, 1.0 * MiB / GiB), res=1024,
                         deadline=200.0, clock=lambda: clock[0], eta=eta)
    assert stop.startswith("time budget (next try")
    assert len(tries) == 2 and clock[0] <= 200.0  # it ran what fitted, and no try ended past the budget
    nxt = int(stop.split("next try ")[1].split(" ")[0].replace(",", ""))
    assert nxt > max(t["tokens"] for t in tries) and clock[0] + step(nxt) > 200.0  # and the next one would have


def test_step_time_model():
    a, b = 1e-4, 3e-9
    pts = [(n, a * n + b * n * n) for n in (8192, 32768, 65536)]
    fa, fb = lcs.fit_step_time(pts)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    fa, fb = lcs.fit_step_time([(32768, 8.0)])  # one point: half linear, half quadratic there
    assert fa * 32768 == pytest.approx(4.0) and fb * 32768**2 == pytest.approx(4.0)
    assert lcs.eta_s([(32768, 8.0)], 65536, overhead_s=5.0) == pytest.approx(5.0 + 8.0 + 16.0)
    assert lcs.eta_s([], 1000, 5.0) is None
    # a fit that would need a negative term falls back to the one-point rule at the longest point
    fa, fb = lcs.fit_step_time([(1000, 5.0), (2000, 5.0)])
    assert fa >= 0 and fb >= 0 and fa * 2000 + fb * 2000**2 == pytest.approx(5.0)


def test_a_try_the_worker_died_under_is_recorded():
    start = dict(event="start", path="fastsft", budget="80 GiB", tokens=262144, kind="search", res=16384)
    done = dict(event="try", path="sft", budget="12 GiB", tokens=9216, kind="search", outcome="ok")
    records = [dict(start, path="sft", budget="12 GiB", tokens=9216), done, start]
    assert lcs.inflight(records) == start and lcs.inflight(records[:2]) is None
    assert lcs.crash_record(start, -9, killed=False)["outcome"] == "host-oom"
    assert lcs.crash_record(start, 1, killed=False)["outcome"] == "error"
    rec = lcs.crash_record(start, -9, killed=True)
    assert rec["outcome"] == "time-cap" and rec["event"] == "try" and rec["tokens"] == 262144 and rec["crashed"]


def test_summary_rows_and_table():
    def tr(budget, gib, tokens, outcome, **kw):
        return dict(event="try", kind="search", path="sft", budget=budget, budget_gib=gib, tokens=tokens,
                    outcome=outcome, error=None if outcome == "ok" else "OutOfMemoryError: CUDA out of memory",
                    peak_gib=kw.get("peak", 0.0), step_s=kw.get("step"), wall_s=3.0, rss_peak_gib=9.5,
                    host_pool_gib=0.0, res=1024)
    records = [tr("12 GiB", 12.0, 8192, "ok", peak=11.1, step=1.1), tr("12 GiB", 12.0, 9216, "ok", peak=11.7, step=1.3),
               tr("12 GiB", 12.0, 10240, "oom"), tr("16 GiB", 16.0, 17408, "oom"),
               dict(event="search_end", path="sft", budget="12 GiB", stopped_by="converged", resolution=1024)]
    s12 = lc.summarize(records, "sft", ("12 GiB", 12.0))
    assert (s12["longest_tokens"], s12["first_failed_tokens"], s12["stopped_by"]) == (9216, 10240, "converged")
    assert s12["step_s"] == 1.3 and s12["peak_gib"] == 11.7 and s12["rss_peak_gib"] == 9.5 and s12["tries"] == 3
    assert s12["mib_per_token"] == pytest.approx(0.6 / 1024 * 1024)
    assert s12["failed_by"].startswith("oom: OutOfMemoryError")
    s16 = lc.summarize(records, "sft", ("16 GiB", 16.0))
    assert s16["longest_tokens"] is None and s16["longest_implied_tokens"] == 9216
    assert s16["longest_implied_from"] == "12 GiB" and s16["stopped_by"].startswith("not finished")
    table = lc.tables([dict(s12), dict(s16)])
    assert "| 12 GiB | sft | 9,216 | 10,240 (oom) | 1.30 | 11.70 | 9.5 / 0.0 | converged; 3 tries" in table
    assert "| 16 GiB | sft | - (>= 9,216 at 12 GiB) | 17,408 (oom) |" in table


def test_tiny_entry_brackets_the_fake_limit_and_writes_its_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    # --max-tries 6: exactly what the search needs (the timing try at 128, then 256, 512, 384, 320, 288)
    argv = ["--tiny", "--paths", "sft,sft_full_logits,fastsft", "--tiny-fake-limit", "300", "--max-tries", "6"]
    payload = lc.main(argv)
    written = json.loads((tmp_path / "long_context.json").read_text())
    assert written == json.loads(json.dumps(payload, default=str))
    assert set(written) == {"benchmark", "date", "command", "git_commit", "environment", "figures", "notes"}
    assert written["benchmark"] == "long_context"
    assert written["command"] == "python -m benchmarks.long_context " + " ".join(argv)
    assert written["notes"].startswith("CPU smoke run (--tiny)") and "mean nothing" in written["notes"]
    assert written["environment"]["machine"].startswith("CPU only")
    figures = written["figures"]
    tries = [r for r in figures if r["row"] == "try"]
    summaries = {r["path"]: r for r in figures if r["row"] == "summary"}
    assert list(summaries) == ["sft", "sft_full_logits", "fastsft"]
    for path, s in summaries.items():
        assert s["stopped_by"] == "converged", s
        assert s["longest_tokens"] <= 300 < s["first_failed_tokens"], s
        assert s["first_failed_tokens"] - s["longest_tokens"] <= s["resolution"] == 32
        assert s["step_s"] > 0 and s["rss_peak_gib"] > 0 and s["loss"] > 0
        own = [t for t in tries if t["path"] == path]
        assert s["tries"] == len(own) == 6
        # the fake limit decided every outcome; every try states its host RAM
        assert all((t["outcome"] == "ok") == (t["tokens"] <= 300) for t in own), own
        assert all(t["rss_peak_gib"] > 0 and t["rss_scope"] == "try" for t in own)
        assert [t["kind"] for t in own].count("timing") == 1
    # same data, same initial LoRA: the three trainers train to the same loss at every length that fitted
    for tokens in {t["tokens"] for t in tries if t["outcome"] == "ok"}:
        losses = {t["path"]: t["loss"] for t in tries if t["tokens"] == tokens and t["outcome"] == "ok"}
        assert len(losses) == 3, (tokens, losses)
        assert losses["sft_full_logits"] == pytest.approx(losses["sft"], rel=1e-5)
        assert losses["fastsft"] == pytest.approx(losses["sft"], rel=1e-4)
    fast = next(t for t in tries if t["path"] == "fastsft" and t["outcome"] == "ok")
    assert any(s.startswith("cached_packing") for s in fast["speedups"])
    timing = [t for t in tries if t["kind"] == "timing"]
    assert all(t["tokens"] == 128 and t["outcome"] == "ok" and len(t["step_s_all"]) == 4 for t in timing)


def test_search_paths_times_the_others_only(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sft,fastsft", "--search-paths", "fastsft", "--tiny-fake-limit", "300",
            "--max-tries", "6"]
    figures = lc.main(argv)["figures"]
    tries = [r for r in figures if r["row"] == "try"]
    assert [t["kind"] for t in tries if t["path"] == "sft"] == ["timing"]
    assert [t["kind"] for t in tries if t["path"] == "fastsft"].count("search") == 5
    summaries = {r["path"]: r for r in figures if r["row"] == "summary"}
    assert summaries["sft"]["stopped_by"] == "not searched (timed only)" and summaries["sft"]["tries"] == 1
    assert summaries["fastsft"]["stopped_by"] == "converged"
    with pytest.raises(SystemExit, match="some of --paths"):
        lc.main(["--tiny", "--paths", "sft", "--search-paths", "fastsft"])


def test_a_budget_dependent_path_draws_its_line_through_this_budgets_fits():
    """tiled_mlp='auto' tiles near the limit only: a fit far below another budget's limit (here 32K at 24 GiB, on
    the untiled line) and this budget's tiled fits do not lie on one line; drawn through both, the line predicts a
    limit far too long (as the first run with 'auto' did: 135K tried where 86K was the limit)."""
    cap = 16 * 0.97
    tiled = lambda t: 6.0 + t * 0.11 * MiB / GiB
    limit = int((cap - 6.0) * GiB / (0.11 * MiB))
    other = dict(event="try", kind="timing", path="p", budget="24 GiB", budget_gib=24.0, tokens=32_768,
                 outcome="ok", peak_gib=11.9, host_short=0, step_s=6.4, wall_s=25.0)
    assert lcs.budget_dependent("fastsft") and lcs.budget_dependent("fastsft[offload_max_host_bytes=8]")
    assert not lcs.budget_dependent("fastsft[tiled_mlp=True]") and not lcs.budget_dependent("sft")
    res = lcs.resolution(limit, 1024)
    runs = {}
    for same in (False, True):
        tries = [dict(other)]
        stop = lcs.run_search(fake_runner("16 GiB", lambda t: t <= limit, tiled), tries, "16 GiB", cap,
                              prior=lcs.prior_line("8b", "fastsft"), res=res, deadline=float("inf"),
                              clock=lambda: 0.0, eta=lambda t: None, start_tokens=65_536, same_budget_line=same)
        assert stop == "converged"
        runs[same] = [t for t in tries if t["budget"] == "16 GiB"]
        check_bracket(runs[same], limit, res)
    assert len(runs[True]) <= 3 < len(runs[False])
    assert max(t["tokens"] for t in runs[True]) < 1.2 * limit


def test_a_measured_line_replaces_the_predicted_prior():
    assert lcs.prior_line("8b", "fastsft") == (0, 6.0, 0.11 * MiB / GiB)  # run 2's line
    assert lcs.prior_line("8b", "sft") == (0, 6.5, 0.58 * MiB / GiB)  # still the prediction
    assert lcs.prior_line("14b", "fastsft") == (0, 10.9, 0.2 * MiB / GiB) and lcs.prior_line("tiny", "sft") is None


def test_a_capped_pool_bends_the_prior_where_it_fills():
    per_token = 32 * 4096 * 2  # the 8B's checkpointed inputs per token, bf16
    full, peak, slope = lcs.prior_line("8b", f"fastsft[offload_max_host_bytes={8 * GiB}]")
    assert full == 8 * GiB // per_token == 32_768
    assert peak == pytest.approx(6.0 + full * 0.11 * MiB / GiB) and slope == pytest.approx((0.11 * MiB + per_token) / GiB)
    limit = predict_max([], 16 * 0.97, (full, peak, slope))
    assert 45_000 < limit < 55_000  # the uncapped line says ~86K at 16 GiB
    assert lcs.prior_line("8b", f"fastsft[offload_max_host_bytes={GiB};offload_checkpointing=False]")[0] == 0
