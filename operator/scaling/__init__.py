"""Pure capacity and scaling logic for the operator.

What it is: the replica planner (``planner.py``: the one place that decides
how many replicas a service runs and which pods go) and the parts it calls —
the HPA formula with its windows and fast path, initial sizing, the drain and
scale-to-zero rules, cold starts — plus parsing of replica ``/metrics``
scrapes, capacity-profile reading, drift and SLO checks. All plain functions
over plain data, driven by an explicit clock so tests can replay timelines.

What it is not: it does no I/O. Scraping pods, patching the scale subresource
and writing status or Events belong to ``plimsoll.operator.handlers``; an
import-linter contract keeps kopf, kubernetes_asyncio and httpx out of here,
and another lets only ``handlers/replica_planning.py`` call the planner.
"""
