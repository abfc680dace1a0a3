"""Publishing a bench JSON report into a Kubernetes ConfigMap (``--report-configmap NS/NAME``).

What it is: how a profiling Job hands its result to the operator — the JSON
report (the contract ``plimsoll.operator.scaling.profile`` reads, never the
per-request data) merge-patched into the ConfigMap under the key
``report.json``. Credentials come from the pod's ServiceAccount (in-cluster) or
$KUBECONFIG. The operator creates the ConfigMap beforehand (owned by the
LLMService) so the Job's Role needs only get/patch on that one name; when it is
missing and the caller may create it, it is created.

What it is not: a general Kubernetes client or a reader of reports.
"""

import json
import os
import re
from dataclasses import dataclass
from typing import Any

REPORT_KEY = "report.json"
# A ConfigMap holds at most 1 MiB in total; keep room for metadata.
MAX_REPORT_BYTES = 1_000_000
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class PublishError(Exception):
    """The report could not be published; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ConfigMapRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_configmap_ref(text: str) -> ConfigMapRef:
    """``NAMESPACE/NAME`` → ConfigMapRef; raises PublishError naming the problem."""
    namespace, sep, name = text.partition("/")
    if not sep or not _DNS_LABEL.match(namespace) or not _DNS_SUBDOMAIN.match(name):
        raise PublishError(
            f"--report-configmap {text!r} is not NAMESPACE/NAME (lower-case DNS names), e.g. default/my-profile"
        )
    return ConfigMapRef(namespace, name)


def report_payload(report: dict[str, Any]) -> str:
    """The report as compact JSON; raises PublishError when it would not fit in a ConfigMap."""
    text = json.dumps(report, separators=(",", ":"), allow_nan=False, default=str)
    size = len(text.encode())
    if size > MAX_REPORT_BYTES:
        raise PublishError(
            f"the JSON report is {size} bytes, more than a ConfigMap holds ({MAX_REPORT_BYTES}); "
            "sweep fewer levels or repeats"
        )
    return text


async def _api_client() -> Any:
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        await config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


async def publish_report(report: dict[str, Any], ref: ConfigMapRef) -> None:
    """Write ``report`` into ConfigMap ``ref`` under ``report.json`` (patch; create when missing)."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException
    from kubernetes_asyncio.config import ConfigException

    payload = report_payload(report)
    try:
        api = await _api_client()
    except (ConfigException, OSError) as error:
        raise PublishError(f"no Kubernetes credentials to publish the report with: {error}") from error
    core = client.CoreV1Api(api)
    try:
        try:
            await core.patch_namespaced_config_map(ref.name, ref.namespace, {"data": {REPORT_KEY: payload}})
        except ApiException as error:
            if error.status != 404:
                raise
            body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=ref.name), data={REPORT_KEY: payload})
            await core.create_namespaced_config_map(ref.namespace, body)
    except ApiException as error:
        raise PublishError(
            f"could not write the report into ConfigMap {ref}: {error.status} {error.reason}"
            + (" (the ServiceAccount needs get and patch on it)" if error.status == 403 else "")
        ) from error
    finally:
        await api.close()
