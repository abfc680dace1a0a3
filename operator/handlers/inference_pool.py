"""Take away the InferencePool of an LLMService that left ``router.mode: inferencePool``.

Applying the pool is an ordinary child of reconcile (``resources/inference_pool.py``);
removing it is not, because a child that is no longer built is otherwise left behind
(owner references only clean up when the LLMService itself goes). Only a pool carrying
the operator's managed-by label is deleted, never one a user made under the same name.
"""

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import delete_owned
from plimsoll.operator.resources.inference_pool import INFERENCE_POOL_GROUP_VERSION, INFERENCE_POOL_PLURAL

_KIND = "InferencePool"


async def remove_unused_inference_pool(kube: Kube, svc: LLMService, logger: Log) -> bool:
    """Delete ``svc``'s InferencePool if the operator made one; True when it did."""
    if not await kube.has_resource(INFERENCE_POOL_GROUP_VERSION, INFERENCE_POOL_PLURAL):
        return False
    if not await delete_owned(kube, svc, INFERENCE_POOL_GROUP_VERSION, _KIND, svc.namespace, svc.name):
        return False
    logger.info("deleted InferencePool %s: router.mode is %s", svc.name, svc.spec.router.mode)
    return True
