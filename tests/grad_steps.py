"""The name its first importers use for ``StepGrads`` and ``max_relative``, which live in ``parity`` (the tests'
parity harness); new tests import them from there."""

from parity import StepGrads, max_relative

__all__ = ["StepGrads", "max_relative"]
