"""Fields added to the engine spec leave the profile hash of a spec that does not set them unchanged."""

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile import profile_spec_hash


def _spec(engine: dict[str, object]) -> LLMService:
    body = {"metadata": {"name": "m"}, "spec": {"model": {"uri": "hf://org/m"}, "engine": engine}}
    return LLMService.from_body(body)


def test_unset_max_new_tokens_keeps_the_hash_and_a_set_one_changes_it() -> None:
    spec = _spec({"kind": "vllm", "maxNumSeqs": 8}).spec
    # The hash as it was computed before engine.maxNewTokens existed: the same engine fields without it.
    before = spec.engine.model_dump(mode="json", exclude={"image", "kind", "max_new_tokens"})
    gpu = {**spec.resources.gpu.model_dump(mode="json"), "nodeSelector": {}}
    old = profile_spec_hash(model="hf://org/m", image="img", engine_kind="vllm", engine_args=before, gpu=gpu)
    assert spec_profile_hash(spec, "img") == old  # recorded profiles stay current after the upgrade
    assert spec_profile_hash(_spec({"kind": "vllm", "maxNumSeqs": 8, "maxNewTokens": 64}).spec, "img") != old
