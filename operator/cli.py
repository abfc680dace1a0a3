"""`plimsoll operator`."""

from plimsoll.unbuilt import not_built


def run_operator() -> None:
    """Run the operator."""
    not_built("operator", "Operator core: the LLMService CRD, reconciliation, Helm chart")
