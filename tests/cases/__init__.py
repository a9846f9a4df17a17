"""What the tests run on other processes, and the machinery that runs it.

- ``*_cases.py``: functions each rank of a process pool runs (importable by the workers), by
  subject: ``pipeline_cases`` (TinyLM pipelines against a single-process reference),
  ``overlap_cases`` and ``moe_trace_cases`` (the MoE stage module, pp 2 x ep 2),
  ``contract_cases`` (the autograd contract's differential harness), ``torch_schedule_cases``
  (torch's own schedule tests on ours), ``tp_cases`` (pp 2 x tp 2), ``check_cases`` (the
  ``check`` command's worker);
- ``layout.py``: the layout most cases use, the first ``pp`` ranks building one pipeline;
- ``dist_pool.py``: the pool of gloo workers that runs them (the ``pool`` fixture in
  tests/conftest.py spawns one per test module);
- ``titan_runs.py``: torchtitan runs as a user launches them, and what their logs say (the
  tests in tests/titan/); ``titan_probe.py``: loaded inside those runs' trainer processes;
- ``titan_cases.py``: torchtitan pieces run on ranks spawned by ``run_on_processes``
  (``titan_dualpipe.testing.spawn``), the spawner the package's tools use.

Nothing here is collected as a test; the tests import it as ``cases.<module>``.
"""
