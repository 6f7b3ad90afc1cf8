"""The live demo of pacerd, shipped beside the daemon but not inside it
(nothing in ``pacerd`` imports this package):

- ``app``: the demo's worker, and the example of how to write one
  (``pacerd worker --app pacerd_demo.app:app``);
- ``producer``: a steady producer for the compose stack
  (``python -m pacerd_demo.producer``);
- ``plan``: what a run is made of (destinations, capacity schedules, backlog);
- ``runner``: runs a plan against the local PostgreSQL and RabbitMQ
  (``python -m pacerd_demo``, which ``scripts/demo.sh`` starts);
- ``report``: the live view, the summary and the chart of a run.

Imports go one way: ``runner`` imports ``report`` and ``plan``, ``report``
imports ``plan``. The model upstream the demo calls is a test tool of the
daemon's package (``pacerd.testing.upstream``), shared with the tests and the
benchmarks.
"""
