"""Pure capacity and scaling logic for the operator.

What it is: parsing of replica ``/metrics`` scrapes, the autoscaler's decision
function (the Kubernetes HPA algorithm plus the queue fast path), initial
replica sizing, capacity-profile reading and SLO checks — all plain functions
over plain data, driven by an explicit clock so tests can replay timelines.

What it is not: it does no I/O. Scraping pods, patching the scale subresource
and writing status or Events belong to ``plimsoll.operator.handlers``; an
import-linter contract keeps kopf, kubernetes_asyncio and httpx out of here.
"""
