"""``apertus eval report``: the report's evaluation tables, reproduced against a served model in one command.

- :mod:`.runner`: the plan (a suite of :mod:`eval_tasks.catalogue`), the checks against the
  server, the resumable run, the written report;
- :mod:`.worker`: one harness's tasks in one process (``python -m eval_tasks.report.worker``);
- :mod:`.server`: what the server serves (its context length, the audio length it accepts);
- :mod:`.render`: the Markdown tables, the SVG picture and the documentation's benchmark table.
"""
