"""GPU benchmarks, side by side with plain TRL (outside the wheel): ``python -m benchmarks.<name>`` from the
repository root. Results in one schema under ``benchmarks/results/`` (see ``benchmarks/README.md``)."""
