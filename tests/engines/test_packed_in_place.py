"""``rollout.engine.pack_in_place``: a worker's engine keeps each linear weight once, as its packed
copy. It samples bit for bit as the engine that keeps both, after updates from a state dict, a
file or a LoRA adapter too; a tied vocabulary projection keeps its weight; a forward outside the
engine's steps is refused; closing the engine gives every weight back exactly."""

import pytest
import torch
from safetensors.torch import save_file

from saorl.config.engines import LocalEngineConfig
from saorl.engines import LocalEngine, SamplingParams
from saorl.engines.packed import PackedLinears, packing_available
from saorl.models.tiny import build_tiny
from tests.engines.conftest import PROMPTS

pytestmark = pytest.mark.skipif(not packing_available(build_tiny("tiny-dense")),
                                reason="this torch build packs no linear weights (no oneDNN)")
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)


def _param_bytes(model: torch.nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def _generate(release: bool, kind: str, tok, update=None) -> tuple[list, torch.nn.Module, dict]:
    model = build_tiny(kind, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with LocalEngine(model, tok, max_batch_size=4, release_weights=release) as eng:
        if update is not None:
            eng.update_weights(update, version=1)
        out = eng.generate([tok.encode(s) for s in PROMPTS], SAMPLED)
        info = {"released": dict(eng._packed.released), "bytes": _param_bytes(model)}
    return out, model, before | {"_info": info}


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_released_weights_sample_bit_for_bit_and_come_back_at_close(kind, tok):
    plain, _, _ = _generate(False, kind, tok)
    held, model, before = _generate(True, kind, tok)
    info = before.pop("_info")
    for a, b in zip(held, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # the same packed copies
    linears = {f"{n}.weight" for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    # everything but the vocabulary projection, which is tied to the embedding the lookup reads
    assert set(info["released"]) == linears - {"lm_head.weight"}
    saved = sum(before[n].numel() * 4 for n in info["released"])
    assert info["bytes"] == _param_bytes(build_tiny(kind, seed=0)) - saved + 4 * len(info["released"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # close() restored them
    assert all(p.stride() != (0, 0) for p in model.parameters())


def test_an_untied_projection_is_released_too(tok):
    model = build_tiny("tiny-dense", seed=0, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    packed = PackedLinears(model, release=True)
    assert "lm_head.weight" in packed.released
    packed.remove()


def test_a_forward_outside_the_engine_is_refused_not_computed_with_zeros():
    model = build_tiny("tiny-dense", seed=1).eval()
    ids = torch.randint(2, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    packed = PackedLinears(model, release=True)
    with pytest.raises(RuntimeError, match="released into the engine's packed copy"):
        model(input_ids=ids)
    with torch.inference_mode(), packed.active():
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=1e-4, atol=1e-4)
    name = next(iter(packed.released))
    assert torch.equal(packed.dense(name), dict(build_tiny("tiny-dense", seed=1).named_parameters())[name])
    packed.remove()
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, plain)


@pytest.mark.parametrize("source", ["state_dict", "file"])
def test_updates_reach_the_released_copies(source, tok, tmp_path):
    new = build_tiny("tiny-dense", seed=7).state_dict()
    if source == "file":
        path = tmp_path / "v1.safetensors"
        save_file({k: v.contiguous() for k, v in new.items() if k != "lm_head.weight"}, str(path))
        update = str(path)
    else:
        update = new
    plain, _, _ = _generate(False, "tiny-dense", tok, update)
    held, model, before = _generate(True, "tiny-dense", tok, update)
    before.pop("_info")
    for a, b in zip(held, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.versions == [1] * len(a.token_ids)
    fresh, _, _ = _generate(False, "tiny-dense", tok)
    assert any(a.token_ids != b.token_ids for a, b in zip(held, fresh, strict=True))  # the update counted
    for k, v in model.state_dict().items():  # after close: the updated weights, exactly
        assert torch.equal(v, new[k]), k


def test_a_wrong_shape_is_refused_before_the_engine_sees_it(tok):
    with LocalEngine(build_tiny("tiny-dense", seed=0), tok, max_batch_size=2, release_weights=True) as eng:
        name = next(iter(eng._packed.released))
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            eng.update_weights({name: torch.zeros(3, 3)}, version=1)


def test_a_lora_adapter_merges_into_the_released_base(tok, tmp_path):
    pytest.importorskip("peft")
    from saorl.runtime.weights.files import FilePublisher, FileSource
    from tests.runtime.learner.test_learner import _matched_trajs, _trajs
    from tests.runtime.learner.test_lora_learner import _lora_learner

    lrn = _lora_learner("tiny-dense")
    lrn.step(_matched_trajs(lrn.policy, _trajs()))
    lrn.publish(FilePublisher(tmp_path / "weights"))
    version, source = FileSource(tmp_path / "weights").latest()
    outs = {}
    for release in (False, True):
        model = build_tiny("tiny-dense", seed=0)
        with LocalEngine(model, tok, max_batch_size=4, release_weights=release) as eng:
            for v in (version, version + 1):  # twice: the second merges into the kept base
                eng.update_weights(source, v)
            outs[release] = eng.generate([tok.encode(s) for s in PROMPTS], SAMPLED)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_a_worker_engine_packs_in_place_unless_told_not_to(tok):
    from saorl.runtime.backends.worker import WorkerSpec, build_engine
    from saorl.runtime.weights.files import FileSource  # noqa: F401  (the worker's import path)

    for in_place in (True, False):
        spec = WorkerSpec(policy="tiny-dense", tokenizer=None, env_type="math_tool", env_options={},
                          weights_dir="", sampling=SAMPLED,
                          engine=LocalEngineConfig(pack_in_place=in_place, slots=2))
        eng = build_engine(spec, tok)
        try:
            assert bool(eng._packed.released) == in_place
        finally:
            eng.close()


def test_a_model_loaded_from_a_file_lets_go_of_the_files_memory_map(tok, tmp_path):
    """transformers loads a float32 safetensors file as views of one memory map: with the weights
    released, the engine copies the rest out so that the map (the whole file) is unmapped."""
    import gc

    from transformers import AutoModelForCausalLM

    build_tiny("tiny-dense", seed=0, tie_word_embeddings=True).save_pretrained(tmp_path / "m")
    path = str(tmp_path / "m" / "model.safetensors")

    def mapped() -> bool:
        gc.collect()
        return path in open("/proc/self/maps").read()

    for release, stays in ((False, True), (True, False)):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
        if not mapped():
            pytest.skip("this transformers copies the file's tensors (no memory map to let go of)")
        eng = LocalEngine(model, tok, max_batch_size=2, release_weights=release)
        assert mapped() == stays
        out = eng.generate([tok.encode("a")], SAMPLED)
        assert len(out[0].token_ids) == SAMPLED.max_new_tokens
        eng.close()
        del model, eng
