"""Benchmarks of the whole pipeline: ``saorl bench pipeline`` (async SAO vs a sync barrier baseline).

Modules: :mod:`~saorl.bench.pipeline` (the benchmark), :mod:`~saorl.bench.runs` (one run and its
figures), :mod:`~saorl.bench.profile` (engine and trainer-step profiles),
:mod:`~saorl.bench.timeline` (Gantt plot), :mod:`~saorl.bench.report` (``summary.md``).
"""
