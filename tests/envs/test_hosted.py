"""Env calls under a deadline (saorl.envs.hosted): real child processes, real kills."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from saorl.envs.base import Task
from saorl.envs.hosted import CallTimeout, HostDied, HostedEnv, child_traceback
from saorl.envs.prompt_reward import RewardFunctionError
from saorl.envs.registry import make_env_factory

from .procs import gone

USER_CODE = '''
import os, re, time

from saorl.envs.base import Env, StepResult

def ok(prompt, completion, answer, **row):
    return 1.0 if completion.strip() == str(answer) else 0.0

def busy(prompt, completion, **row):
    while True:  # pure Python, never yields
        pass

def gil(prompt, completion, **row):
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking in C: holds the GIL throughout
    return 0.0

def sleepy(prompt, completion, **row):
    time.sleep(10**9)

def boom(prompt, completion, **row):
    raise KeyError("no such thing")

def pid(prompt, completion, **row):
    return os.getpid()

def n_ids(prompts, completions, completion_ids, **columns):  # TRL's style: lists of one
    return [float(len(ids)) if ids is not None else -1.0 for ids in completion_ids]

class Counter(Env):
    """Two turns; the state (a count) must travel between the calls."""
    name = "counter"
    stop_strings = ("!",)
    max_turns = 3

    def generate_tasks(self, split, n, seed):
        return []

    def reset(self, task, progress=None):
        self.count = 0
        return "count"

    def step(self, action):
        self.count += len(action)
        return StepResult(f"{self.count}", float(self.count), self.count >= 5, {"success": True})

class Unpicklable(Counter):
    def reset(self, task, progress=None):
        self.handle = open(os.devnull)
        return "count"
'''
TASK = Task("t7", {"prompt": "What is 2+3?", "answer": 5})


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "hosted_user_code.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the children get this sys.path
    sys.modules.pop("hosted_user_code", None)


def _reward_env(fn: str, timeout_s: float = 30.0):
    options = {"reward_fn": f"hosted_user_code:{fn}"}
    return make_env_factory("prompt_reward", options, call_timeout_s=timeout_s)


def test_a_hosted_reward_function_scores_as_in_process_in_one_warm_child(user_code):
    with _reward_env("ok") as factory:
        results = []
        for action in ("5", "4", " 5 "):
            env = factory()
            assert isinstance(env, HostedEnv) and env.stop_strings == () and env.max_turns == 1
            assert env.reset(TASK) == "What is 2+3?"
            results.append(env.step(action))
        assert [(r.reward, r.done, r.info["success"]) for r in results] == [
            (1.0, True, True), (0.0, True, False), (1.0, True, True)]
        assert factory.pool.started == 1  # one warm child served every call
    plain = make_env_factory("prompt_reward", {"reward_fn": "hosted_user_code:ok"})()  # no deadline: here
    plain.reset(TASK)
    assert not isinstance(plain, HostedEnv) and plain.step("5").reward == 1.0


def test_the_reward_function_runs_in_the_child_not_here(user_code):
    with _reward_env("pid") as factory:
        env = factory()
        env.reset(TASK)
        child = int(env.step("x").reward)
    assert child != os.getpid()
    assert gone(child)  # closing the factory ended it


@pytest.mark.parametrize("fn", ["busy", "gil", "sleepy"])
def test_a_call_past_its_deadline_is_killed_and_named(user_code, fn):
    with _reward_env(fn, timeout_s=1.0) as factory:
        env = factory()
        env.reset(TASK)
        t0 = time.monotonic()
        with pytest.raises(CallTimeout) as info:
            env.step("5")
        took = time.monotonic() - t0
        assert 1.0 <= took < 6.0, took
        msg = str(info.value)
        assert f"reward function 'hosted_user_code:{fn}'" in msg and "task 't7'" in msg
        assert "{'answer': 5}" in msg and "within 1 s (env.call_timeout_s)" in msg
        assert factory.pool.started == 1
        env = factory()  # the next call gets a fresh child
        env.reset(TASK)
        assert factory.pool.started == 2


def test_the_killed_child_is_gone_and_the_pool_goes_on(user_code, tmp_path):
    code = USER_CODE + ("\ndef slow_pid(prompt, completion, **row):\n"
                        "    open(row['path'], 'w').write(str(os.getpid()))\n    while True:\n        pass\n")
    (tmp_path / "hosted_user_code.py").write_text(code)
    sys.modules.pop("hosted_user_code", None)
    task = Task("t8", {"prompt": "p", "path": str(tmp_path / "pid")})
    with _reward_env("slow_pid", timeout_s=1.0) as factory:
        env = factory()
        env.reset(task)
        with pytest.raises(CallTimeout):
            env.step("x")
        assert gone(int((tmp_path / "pid").read_text()))


ESCAPE = """
def _detach(pids_dir):
    # fork, setsid, fork again: a process out of the child's group, re-parented to init
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            open(os.path.join(pids_dir, str(os.getpid())), "w").close()
            time.sleep(10**6)
        os._exit(0)
    os.wait()

def escape(prompt, completion, **row):
    for _ in range(3):
        _detach(row["pids"])
    return 0.0

def escape_and_hang(prompt, completion, **row):
    _detach(row["pids"])
    while True:
        pass
"""


def _escapees(tmp_path, fn: str, timeout_s: float, n: int) -> list[int]:
    """The pids of the ``n`` processes ``fn`` detached, each checked alive or gone as it should be."""
    (tmp_path / "hosted_user_code.py").write_text(USER_CODE + ESCAPE)
    sys.modules.pop("hosted_user_code", None)
    pids = tmp_path / "pids"
    pids.mkdir()
    task = Task("t9", {"prompt": "p", "pids": str(pids)})

    def found() -> list[int]:
        deadline = time.monotonic() + 5.0
        while len(list(pids.iterdir())) < n and time.monotonic() < deadline:
            time.sleep(0.02)  # the detached ones write their pid on their own time
        return [int(p.name) for p in pids.iterdir()]

    with _reward_env(fn, timeout_s=timeout_s) as factory:
        env = factory()
        env.reset(task)
        try:
            env.step("x")
            assert not any(gone(p) for p in found())  # alive while the pool is open
        except CallTimeout:  # on the deadline, the detached one is gone with the child at once
            assert found() and all(gone(p) for p in found()), found()
    return found()


def test_processes_a_reward_function_detaches_are_killed_when_the_pool_closes(user_code, tmp_path):
    pids = _escapees(tmp_path, "escape", timeout_s=30.0, n=3)
    assert len(pids) == 3 and all(gone(p) for p in pids), pids


def test_a_process_detached_by_a_call_past_its_deadline_is_killed_with_it(user_code, tmp_path):
    pids = _escapees(tmp_path, "escape_and_hang", timeout_s=1.0, n=1)
    assert len(pids) == 1 and all(gone(p) for p in pids), pids


def test_an_exception_in_user_code_comes_back_as_itself_with_the_childs_traceback(user_code):
    with _reward_env("boom") as factory:
        env = factory()
        env.reset(TASK)
        with pytest.raises(RewardFunctionError, match=r"'hosted_user_code:boom' on task 't7'.*KeyError") as e:
            env.step("5")
        assert "raise KeyError" in child_traceback(e.value)  # the child's traceback
        assert factory.pool.started == 1  # an error is not a reason to replace the child


def test_a_custom_env_keeps_its_state_across_calls_in_any_child(user_code):
    with make_env_factory("hosted_user_code:Counter", call_timeout_s=30.0) as factory:
        env = factory()
        assert isinstance(env, HostedEnv) and env.name == "counter" and env.stop_strings == ("!",)
        assert env.reset(TASK) == "count"
        assert env.step("ab").observation == "2"
        assert (env.step("abc").observation, env.step("").done) == ("5", True)


def test_an_env_whose_state_does_not_pickle_says_how_to_fix_it(user_code):
    with (make_env_factory("hosted_user_code:Unpicklable", call_timeout_s=30.0) as factory,
          pytest.raises(TypeError, match=r"does not pickle.*env\.call_timeout_s=null")):
        factory().reset(TASK)


def test_built_in_envs_run_here_and_a_class_that_is_not_importable_is_refused():
    assert not isinstance(make_env_factory("math_tool", call_timeout_s=1.0)(), HostedEnv)

    from saorl.envs.base import Env

    class Local(Env):
        def generate_tasks(self, split, n, seed):
            return []

        def reset(self, task, progress=None):
            return ""

        def step(self, action):
            raise NotImplementedError

    from saorl.envs.registry import EnvFactory

    with pytest.raises(ValueError, match=r"importable by its name.*env\.call_timeout_s=null"):
        EnvFactory(Local, {}, Local(), 1.0)  # defined in a function: no child could import it


def test_close_ends_a_call_that_is_stuck(user_code):
    import threading

    factory = _reward_env("busy", timeout_s=600.0)
    env = factory()
    env.reset(TASK)
    out = []

    def stuck() -> None:
        with pytest.raises(HostDied):
            env.step("5")
        out.append("raised")

    t = threading.Thread(target=stuck)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    factory.close()
    t.join(10.0)
    assert not t.is_alive() and out and time.monotonic() - t0 < 5.0
    with pytest.raises(HostDied, match="closed"):
        factory().reset(TASK)


def test_a_stuck_child_dies_with_its_parent_however_the_parent_died(user_code, tmp_path):
    """The parent is SIGKILLed while its child busy-loops: nothing could tell the child, the kernel does."""
    script = textwrap.dedent(f'''
        import sys, threading
        sys.path.insert(0, {str(tmp_path)!r})
        from saorl.envs.base import Task
        from saorl.envs.registry import make_env_factory
        options = {{"reward_fn": "hosted_user_code:busy"}}
        factory = make_env_factory("prompt_reward", options, call_timeout_s=600.0)
        env = factory()
        env.reset(Task("t", {{"prompt": "p"}}))
        threading.Thread(target=env.step, args=("x",), daemon=True).start()
        import time; time.sleep(1.0)
        print(factory.pool.pids()[0], flush=True)
        time.sleep(600)
    ''')
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10.0
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(child)
    finally:
        parent.kill()


def test_a_hosted_env_hands_the_sampled_ids_to_a_trl_style_reward_and_weights_apply(user_code):
    """The agent loop's note_action_ids reaches the env in the child (TRL's completion_ids);
    several functions with weights keep working across the pickling of the env's state."""
    options = {"reward_fn": ["hosted_user_code:n_ids", "hosted_user_code:ok"], "reward_weights": [1.0, 10.0]}
    with make_env_factory("prompt_reward", options, call_timeout_s=30.0) as factory:
        env = factory()
        env.reset(TASK)
        env.note_action_ids([11, 12, 13])
        res = env.step("5")
        assert res.reward == 3.0 + 10.0
        assert res.info["metrics"] == {"reward/n_ids": 3.0, "reward/ok": 1.0}
        env = factory()
        env.reset(TASK)
        assert env.step("4").reward == -1.0  # played as text: no ids


def test_a_hosted_env_carries_the_runs_observation_format():
    factory = make_env_factory("prompt_reward", {"reward_fn": "saorl.envs.rewards:number_answer"},
                               call_timeout_s=30.0, observation_format="chat", observation_role="user")
    with factory:
        env = factory()  # built without starting a child: only reset and step go there
        assert isinstance(env, HostedEnv)
        assert (env.observation_format, env.observation_role) == ("chat", "user")


def test_a_run_never_keeps_a_mark_it_inherited(monkeypatch):
    """A run started by another saorl process (an experiment's arm, a test) gets a mark of its own, so
    its end kills only what its own user code detached."""
    from saorl.envs import escapees

    monkeypatch.setenv(escapees.RUN_MARK, "inherited-from-a-parent-run")
    assert escapees.run_mark() == "inherited-from-a-parent-run"  # pools inside one run share it
    fresh = escapees.new_run_mark()
    assert fresh != "inherited-from-a-parent-run" and os.environ[escapees.RUN_MARK] == fresh
    assert escapees.new_run_mark() != fresh  # the next run in this process gets another


def test_ps_names_the_reward_hosts_and_their_run(user_code, monkeypatch):
    """`ps -eo args` shows `saorl: reward host N of run NAME`, `ps -eo comm` its first 15 characters."""
    from saorl.proctitle import RUN_ENV

    monkeypatch.setenv(RUN_ENV, "sao-sums-20261206")
    with _reward_env("pid") as factory:
        factory().reset(TASK)
        (pid,) = factory.pool.pids()
        args, comm = (subprocess.run(["ps", "-o", f"{field}=", "-p", str(pid)], capture_output=True,
                                     text=True).stdout.strip() for field in ("args", "comm"))
    assert (args, comm) == ("saorl: reward host 0 of run sao-sums-20261206", "saorl: reward h")
