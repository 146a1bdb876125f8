"""Start-up checks: each problem is one paragraph naming the setting and the fix; task files are
checked against the env row by row, within a time budget."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from saorl.config import load_config
from saorl.envs.registry import make_env_factory
from saorl.errors import StartupError
from saorl.models.serialize import export_policy
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.stages.preflight import (
    check_device,
    check_env,
    check_models,
    check_run,
    check_servers,
    check_tasks,
)

ENV_MODULE = textwrap.dedent('''
    import time
    from saorl.envs.base import Env, StepResult, Task

    class Counting(Env):
        """Accepts tasks with a 'ok' key; counts resets; optionally slow."""
        resets = 0

        def __init__(self, delay: float = 0.0):
            self.delay = delay

        def generate_tasks(self, split, n, seed):
            return [Task(f"{split}-{i}", {"ok": True}) for i in range(n)]

        def reset(self, task, progress=None):
            type(self).resets += 1
            time.sleep(self.delay)
            if "ok" not in task.data:
                raise KeyError("ok")
            return "go"

        def step(self, action):
            return StepResult("", 1.0, True, {"success": True})
''')


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "preflight_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import preflight_envs

    preflight_envs.Counting.resets = 0
    yield preflight_envs
    monkeypatch.delitem(__import__("sys").modules, "preflight_envs", raising=False)


def _tasks(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_paragraph(info) -> str:
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg
    return msg


def test_first_bad_row_is_named_by_file_row_and_id_in_either_split(tmp_path, env_module):
    rows = [{"id": f"t{i}", "ok": 1} for i in range(10)]
    rows[7] = {"id": "bad", "nope": 1}  # row 8: in the held-out test split (the last 4 rows)
    path = _tasks(tmp_path / "tasks.jsonl", rows)
    cfg = load_config(None, ["env.type=preflight_envs:Counting", f"env.tasks_file={path}",
                             "env.num_test_tasks=4", "sft.enabled=false"])
    with pytest.raises(StartupError) as info:
        check_tasks(cfg, make_env_factory(cfg.env.type))
    msg = _one_paragraph(info)
    assert f"{path}: row 8 (task id 'bad')" in msg and "KeyError" in msg and "fix the row" in msg
    # a separate test file: rows counted in that file
    test = _tasks(tmp_path / "test.jsonl", [{"id": "u0", "ok": 1}, {"id": "u1"}])
    cfg = load_config(None, ["env.type=preflight_envs:Counting", f"env.tasks_file={path}",
                             f"env.test_tasks_file={test}", "sft.enabled=false"])
    rows[7] = {"id": "t7", "ok": 1}
    _tasks(path, rows)
    with pytest.raises(StartupError, match=rf"{test}: row 2 \(task id 'u1'\)"):
        check_tasks(cfg, make_env_factory(cfg.env.type))


def test_every_file_task_is_reset_once_and_only_four_generated_ones(tmp_path, env_module):
    path = _tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "ok": 1} for i in range(30)])
    cfg = load_config(None, ["env.type=preflight_envs:Counting", f"env.tasks_file={path}",
                             "env.num_test_tasks=5", "sft.enabled=false"])
    factory = make_env_factory(cfg.env.type)
    env_module.Counting.resets = 0
    check_tasks(cfg, factory)
    assert env_module.Counting.resets == 30
    env_module.Counting.resets = 0
    check_tasks(load_config(None, ["env.type=preflight_envs:Counting"]), factory)
    assert env_module.Counting.resets == 4  # the first generated test tasks: their prompts render


def test_a_slow_env_is_checked_within_the_budget_first_task_of_each_split_always(tmp_path, env_module):
    path = _tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "ok": 1} for i in range(40)] + [{"id": "late"}])
    cfg = load_config(None, ["env.type=preflight_envs:Counting", "env.options.delay=0.05",
                             f"env.tasks_file={path}", "env.num_test_tasks=10", "sft.enabled=false"])
    t0 = time.monotonic()
    check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options), budget_s=0.2)  # 'late' not reached
    assert time.monotonic() - t0 < 1.5
    assert 2 <= env_module.Counting.resets < 20
    with pytest.raises(StartupError, match="late"):  # with time enough, it is
        check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options), budget_s=60)


def test_conversational_rows_need_a_chat_template_and_well_formed_messages(tmp_path):
    """TRL's conversational format in a Hub-style JSONL (no ids): refused at start-up, naming the fix,
    with a tokenizer that has no chat template (the tiny kinds' shipped one); accepted with one;
    a malformed message is named by file and row."""
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "1+1?"}]
    path = _tasks(tmp_path / "train.jsonl", [{"prompt": chat, "answer": 2}, {"prompt": "2+2?", "answer": 4}])
    over = ["env.type=prompt_reward", "env.options.reward_fn=saorl.envs.rewards:number_answer",
            f"env.tasks_file={path}", "env.num_test_tasks=1", "sft.enabled=false"]
    cfg = load_config(None, over)
    with pytest.raises(StartupError) as info:
        check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))
    msg = _one_paragraph(info)
    assert msg.startswith(f"{path}: row 1 (task id 'row-") and "the prompt is a conversation" in msg
    assert "has none. Use a model whose tokenizer has one" in msg and "model.tokenizer" in msg
    tok_dir = tmp_path / "tok"
    hf = load_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(str(tok_dir))
    cfg = load_config(None, [*over, f"model.tokenizer={tok_dir}"])
    check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))
    off = load_config(None, [*over, f"model.tokenizer={tok_dir}", "model.chat_template=false"])
    with pytest.raises(StartupError, match=r"model\.chat_template is false: set model\.chat_template=true"):
        check_tasks(off, make_env_factory(off.env.type, off.env.options))
    _tasks(path, [{"prompt": chat, "answer": 2}, {"prompt": [{"content": "hi"}], "answer": 1},
                  {"prompt": "2+2?", "answer": 4}])
    with pytest.raises(StartupError) as info:
        check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))
    msg = _one_paragraph(info)
    assert msg.startswith(f"{path}: row 2 (task id 'row-") and "message 1 has no role" in msg


def test_env_module_class_and_options(env_module):
    cases = [("env.type=no_such_pkg.envs:Env", "no module named 'no_such_pkg'", "PYTHONPATH"),
             ("env.type=preflight_envs:Missing", "has no attribute 'Missing'", "saorl envs list"),
             ("env.options.colour=red", "unknown options: ['colour']", "MathToolEnv accepts: family")]
    for override, what, fix in cases:
        with pytest.raises(StartupError) as info:
            check_env(load_config(None, [override]))
        msg = _one_paragraph(info)
        assert what in msg and fix in msg, msg


def test_reward_function_errors_say_only_what_applies(env_module, tmp_path):
    """A name with a typo gets "did you mean"; the PYTHONPATH hint only when the module was not
    found; never the list of the env's options (the option was right, its value was not)."""
    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    cases = [("saorl.envs.rewards:number_answr", "has no attribute 'number_answr' (did you mean "
              "'number_answer'?)", False),
             ("saorl.envs.rewardz:number_answer", "no module named 'saorl.envs.rewardz' (did you mean "
              "'saorl.envs.rewards'?)", True),
             ("no_such_rewards_pkg:f", "no module named 'no_such_rewards_pkg'", True),
             ("broken_rewards:f", "importing module 'broken_rewards' failed: ModuleNotFoundError", False)]
    for spec, what, hint in cases:
        cfg = load_config(None, ["env.type=prompt_reward", f"env.options.reward_fn={spec}"])
        with pytest.raises(StartupError) as info:
            check_env(cfg)
        msg = _one_paragraph(info)
        assert what in msg, msg
        assert ("PYTHONPATH" in msg) == hint and "accepts:" not in msg, msg


def test_models_hub_id_non_model_dir_tokenizer_and_critic(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # as on a machine without the Hub
    cfg = load_config(None)
    for policy, expected in [("saorl-tests/not-cached", "hf download saorl-tests/not-cached --local-dir DIR"),
                             (str(tmp_path), "has no config.json"),
                             (str(tmp_path / "missing"), "does not exist")]:
        cfg.model.policy = policy
        with pytest.raises(StartupError) as info:
            check_models(cfg.model, use_critic=True)
        assert expected in _one_paragraph(info) and "model.policy" in str(info.value)
    cfg.model.policy = str(export_policy(build_tiny("tiny-dense"), load_tokenizer(), tmp_path / "policy"))
    check_models(cfg.model, use_critic=True)  # a real model directory passes
    cfg.model.critic = str(tmp_path / "no-critic")
    with pytest.raises(StartupError, match=r"model\.critic=null"):
        check_models(cfg.model, use_critic=True)
    check_models(cfg.model, use_critic=False)  # GRPO never reads it
    cfg.model.critic, cfg.model.tokenizer = None, str(tmp_path)
    with pytest.raises(StartupError, match=r"holds no tokenizer\.json"):
        check_models(cfg.model, use_critic=True)


def test_device_that_is_not_there():
    import torch

    check_device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(StartupError, match=r"torch sees no CUDA device.*model\.device=cpu"):
            check_device("cuda:0")
    else:
        with pytest.raises(StartupError, match="pick one of them"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_sft_needs_demonstrations_unless_disabled():
    cfg = load_config(None, ["env.type=synthetic"])
    with pytest.raises(StartupError) as info:
        check_run(cfg)
    assert "sft.enabled=false" in _one_paragraph(info)
    cfg.sft.enabled = False
    check_run(cfg)
    check_run(load_config(None))  # the defaults pass (math_tool has demonstrations)


def test_tasks_of_env_dataset_are_checked_and_named_by_split_and_row(tmp_path, env_module):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list([{"id": f"t{i}", "ok": 1} for i in range(3)])
    dd = datasets.DatasetDict({"train": train,
                               "test": datasets.Dataset.from_list([{"id": "u0", "nope": 1}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = load_config(None, ["env.type=preflight_envs:Counting", f"env.dataset.path={tmp_path / 'dd'}",
                             "sft.enabled=false"])
    env_module.Counting.resets = 0
    with pytest.raises(StartupError) as info:
        check_tasks(cfg, make_env_factory(cfg.env.type))
    assert f"{tmp_path / 'dd'} [test]: row 1 (task id 'u0')" in _one_paragraph(info)
    assert env_module.Counting.resets == 4  # the three training rows passed
    cfg = load_config(None, ["env.type=preflight_envs:Counting", f"env.dataset.path={tmp_path / 'dd'}",
                             "env.dataset.test_split=valid", "sft.enabled=false"])
    with pytest.raises(StartupError, match=r"has no split 'valid'.*point env\.dataset\.path at other data"):
        check_tasks(cfg, make_env_factory(cfg.env.type))


def test_vllm_servers_that_do_not_answer_are_named_before_anything_runs():
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.engine.urls=[http://127.0.0.1:9, http://127.0.0.1:11]"])
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"engine.urls: 2 of 2 vLLM servers do not answer") as e:
        check_servers(cfg)
    assert "http://127.0.0.1:9 (" in str(e.value) and "http://127.0.0.1:11 (" in str(e.value)
    assert time.monotonic() - t0 < 30  # a server still starting is waited for ~12 s, not forever


def test_a_server_that_says_nothing_of_itself_is_not_refused(tmp_path):
    """saorl's emulation (like an older vLLM) has no /version or /server_info: nothing is refused
    at start-up; the check after the publications still verifies its log-probs."""
    from saorl.engines.local import LocalEngine
    from saorl.engines.serve.server import serve_in_thread

    tok = load_tokenizer()
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), tok, max_batch_size=2)
    srv, url = serve_in_thread(eng, tokenizer=tok, weights_dir=tmp_path, emulate="vllm")
    try:
        check_servers(load_config(None, ["rollout.engine=vllm", f"rollout.engine.urls=[{url}]",
                                         "rollout.temperature=0.7"]))
    finally:
        srv.shutdown()
        eng.close()


@pytest.mark.parametrize(("info", "moe", "processed", "refused"), [
    (dict(device="cpu", logprobs_mode="processed_logprobs", plugin=False), True, True, "Mixture-of-Experts"),
    (dict(device="cpu", logprobs_mode="processed_logprobs", plugin=True), True, True, None),
    (dict(device="cuda", logprobs_mode="processed_logprobs", plugin=False), True, True, None),
    (dict(device="cpu", logprobs_mode="processed_logprobs", plugin=False), False, True, None),
    (dict(device="cuda", logprobs_mode="raw_logprobs", plugin=True), False, True, "--logprobs-mode"),
    (dict(device="cuda", logprobs_mode="raw_logprobs", plugin=True), False, False, None),
    (dict(device=None, logprobs_mode=None, plugin=False), True, True, None),
    (dict(device="cuda", logprobs_mode="processed_logits", plugin=False), False, False, "returns logits"),
    (dict(device="cuda", logprobs_mode="processed_logprobs", plugin=False, dev_mode=False), False, False,
     "VLLM_SERVER_DEV_MODE=1"),
])
def test_which_vllm_servers_a_run_refuses(info, moe, processed, refused):
    from saorl.engines.clients.vllm_client import ServerInfo, incompatibility

    problem = incompatibility(ServerInfo("http://s:1", "0.32.0", dtype="float32", **info), moe=moe,
                              processed=processed, dtype="float32")
    assert (problem is None) == (refused is None)
    if refused:
        assert refused in problem and "http://s:1" in problem


def test_a_vllm_server_in_another_dtype_is_refused_unless_a_tolerance_is_given():
    from saorl.engines.clients.vllm_client import ServerInfo, incompatibility

    info = ServerInfo("http://s:1", "0.32.0", "cuda", "bfloat16", "processed_logprobs", False, dev_mode=True)
    assert "--dtype float32" in incompatibility(info, moe=False, processed=True, dtype="float32")
    assert incompatibility(info, moe=False, processed=True, dtype="bfloat16") is None
    assert incompatibility(info, moe=False, processed=True, dtype=None) is None  # verify_tol set


@pytest.mark.parametrize(("lora", "rank", "refused"), [
    (dict(max_lora_rank=0), 8, "started without --enable-lora"),
    (dict(max_lora_rank=8, lora_updates=True), 16,
     "up to rank 8 (--max-lora-rank) and the run publishes rank 16"),
    (dict(max_lora_rank=8, lora_updates=False), 8, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    (dict(max_lora_rank=8, lora_updates=True), 8, None),
    (dict(), 8, None),  # a server that says nothing of its LoRA: the first load tells
])
def test_which_vllm_servers_a_lora_run_refuses(lora, rank, refused):
    from saorl.engines.clients.vllm_client import ServerInfo, incompatibility

    info = ServerInfo("http://s:1", "0.32.0", "cpu", "float32", "processed_logprobs", False, dev_mode=True,
                      **lora)
    problem = incompatibility(info, moe=False, processed=True, dtype="float32", lora_rank=rank)
    assert (problem is None) == (refused is None)
    if refused:
        assert refused in problem and "http://s:1" in problem
    assert incompatibility(info, moe=False, processed=True, dtype="float32") is None  # full weights


def test_the_lora_flags_named_are_ones_vllm_accepts():
    from saorl.engines.clients.vllm_client import ServerInfo, incompatibility, lora_rank_flag

    assert [lora_rank_flag(r) for r in (1, 4, 8, 9, 33, 512)] == [1, 8, 8, 16, 64, 512]
    info = ServerInfo("http://s:1", "0.32.0", "cpu", "float32", "processed_logprobs", False, dev_mode=True,
                      max_lora_rank=0)
    assert "--enable-lora --max-lora-rank 16 --max-loras 2" in incompatibility(
        info, moe=False, processed=False, lora_rank=12)


def test_a_lora_moe_run_is_refused_on_a_cpu_server_not_on_a_gpu_one():
    """vLLM's CPU build dies on the first request of a LoRA-enabled MoE model; on a GPU the
    adapters are loaded beside the base, never reloaded into it, so the reload plugin is not asked."""
    from saorl.engines.clients.vllm_client import ServerInfo, incompatibility

    lora = dict(max_lora_rank=8, lora_updates=True, dev_mode=True)
    cpu = ServerInfo("http://s:1", "0.32.0", "cpu", "float32", "processed_logprobs", True, **lora)
    assert "Triton fused-MoE kernels, which have no CPU backend" in incompatibility(
        cpu, moe=True, processed=True, lora_rank=8)
    assert incompatibility(cpu, moe=True, processed=True) is None  # full weights, with the plugin
    assert incompatibility(cpu, moe=False, processed=True, lora_rank=8) is None
    gpu = ServerInfo("http://s:1", "0.32.0", "cuda", "float32", "processed_logprobs", False, **lora)
    assert incompatibility(gpu, moe=True, processed=True, lora_rank=8) is None


CHATML_TOOLS = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
                "{{ m.content }}\n</tool_response>{{ eos_token }}\n{% else %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_dir(path, template):
    hf = load_tokenizer()
    hf.chat_template = template
    hf.save_pretrained(str(path))
    return path


def test_chat_observations_need_a_template_that_adds_them_as_turns(tmp_path, env_module):
    """env.observation_format=chat is checked at start-up (a probe episode), in one paragraph: no
    chat template, a template that cannot add a turn (a Qwen3-style one can), and an env class whose
    own format is unknown."""
    chat = ["env.observation_format=chat", "sft.enabled=false"]
    with pytest.raises(StartupError) as info:
        check_run(load_config(None, chat))  # the tiny kinds' shipped tokenizer has no template
    msg = _one_paragraph(info)
    assert msg.startswith("env.observation_format=chat renders observations through the chat template, and "
                          "the run's tokenizer (the shipped one) has none.")
    assert "env.observation_format=text" in msg
    good = _tokenizer_dir(tmp_path / "good", CHATML_TOOLS)
    check_run(load_config(None, [*chat, f"model.tokenizer={good}"]))
    thinks = _tokenizer_dir(tmp_path / "thinks", CHATML_TOOLS.replace(  # Qwen3-style: the last one thinks
        "{% else %}<|im_start|>{{ m.role }}\n", "{% else %}<|im_start|>{{ m.role }}\n{% if loop.last and "
        "m.role == 'assistant' %}<think>\n\n</think>\n\n{% endif %}"))
    check_run(load_config(None, [*chat, f"model.tokenizer={thinks}"]))
    shouts = _tokenizer_dir(tmp_path / "shouts", CHATML_TOOLS.replace("{{ m.content }}{{",
                                                                      "{{ m.content | upper }}{{"))
    with pytest.raises(StartupError) as info:
        check_run(load_config(None, [*chat, f"model.tokenizer={shouts}"]))
    msg = _one_paragraph(info)
    assert "the chat template cannot add an observation as a turn: it does not write the assistant's " \
           "message once, as it is" in msg
    assert "set env.observation_format=text" in msg
    check_run(load_config(None, [f"model.tokenizer={shouts}", "sft.enabled=false"]))  # text: no template use
    env_module.Counting.observation_format = "xml"
    try:
        with pytest.raises(StartupError) as info:
            check_run(load_config(None, ["env.type=preflight_envs:Counting", "sft.enabled=false"]))
        msg = _one_paragraph(info)
        assert "observation_format must be one of ['text', 'chat'], got 'xml'" in msg
        assert "Counting.observation_format" in msg
        env_module.Counting.observation_format = "chat"  # an env whose own default is chat
        with pytest.raises(StartupError, match="has none"):
            check_run(load_config(None, ["env.type=preflight_envs:Counting", "sft.enabled=false"]))
        check_run(load_config(None, ["env.type=preflight_envs:Counting", "sft.enabled=false",
                                     "env.observation_format=text"]))  # the run's setting wins
    finally:
        del env_module.Counting.observation_format


def test_a_pretrained_policy_at_the_tiny_models_learning_rates_gets_a_warning():
    from saorl.stages.preflight import check_learning_rates

    def said(*overrides):
        lines = []
        check_learning_rates(load_config(None, list(overrides)), lines.append)
        return lines

    assert said() == []  # the tiny kinds keep their rates
    assert said("model.policy=/models/smollm2") == []  # left unset: a pretrained model's (1e-5 / 5e-5)
    (line,) = said("model.policy=/models/smollm2", "trainer.policy_lr=1e-4", "trainer.critic_lr=1e-3")
    assert line.startswith("warning: trainer.policy_lr=0.0001, trainer.critic_lr=0.001 for a pretrained")
    assert "docs/real-model.md" in line
    (line,) = said("model.policy=/models/smollm2", "trainer.critic_lr=1e-3")
    assert line.startswith("warning: trainer.critic_lr=0.001 for a pretrained model")
    assert said("model.policy=/models/smollm2", "trainer.policy_lr=1e-5", "trainer.critic_lr=5e-5") == []
