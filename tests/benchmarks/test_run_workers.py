"""``benchmarks.common.run_workers``: the process pool curves and step_rounding run their paths in. Each job runs
``python -m <module> --worker <spec>`` with its spec written and its output logged under its folder; ``finished`` is
called once per job with the exit status and the log's tail. Stdlib modules stand in for a worker here: ``this``
prints and exits 0 whatever its arguments, ``json.tool`` refuses ``--worker`` and exits 2."""

from __future__ import annotations

import json

from benchmarks.common import run_workers


def test_every_job_runs_once_in_its_own_process_and_reports(tmp_path):
    jobs = [{"work": str(tmp_path), "key": f"job{i}"} for i in range(3)]
    seen: list[tuple[str, int, str]] = []
    run_workers(jobs, 2, "this", lambda job, rc, tail: seen.append((job["key"], rc, tail)))
    assert sorted(k for k, _, _ in seen) == ["job0", "job1", "job2"]
    assert all(rc == 0 and "Beautiful is better than ugly" in tail for _, rc, tail in seen)
    assert json.loads((tmp_path / "job1.json").read_text()) == jobs[1]  # the spec the worker is given


def test_a_failing_worker_reports_its_status_and_output(tmp_path):
    seen: list[tuple[int, str]] = []
    run_workers([{"work": str(tmp_path), "key": "bad"}], 1, "json.tool", lambda job, rc, tail: seen.append((rc, tail)))
    ((rc, tail),) = seen
    assert rc != 0 and "--worker" in tail
