"""The CPU tuning of the two-core figures (tools/cpu/tuning.py), applied through `run.launch_hooks`.

jaxpipe itself tunes nothing on the CPU: a module named by `run.launch_hooks`
is imported at launch and its hooks called (`jaxpipe.launch.Hooks`); these
tests check that path and what the CPU tuning's hooks do.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxpipe import accel, config as config_lib, launch
from jaxpipe.errors import ConfigError
from jaxpipe.pipeline import ScheduleOptions
from tests import _runs
from tools.cpu import tuning

HOOKS = "run.launch_hooks=tools.cpu.tuning"


@pytest.fixture
def clean_state(monkeypatch):
  """The tuning's per-process state, restored after the test."""
  monkeypatch.setattr(tuning, "_STATE",
                      {"threads_before": set(), "compile_cores": None, "cpu": False})


def test_the_package_imports_no_cpu_tuning():
  """jaxpipe/ imports nothing of tools/ (the tuning, the trace account) and calls no mallopt
  or idle class; its schedules and model import no `accel` at all: the hooks are the way in."""
  imports = re.compile(r"^\s*(?:from|import)\s+(\S+)(?:\s+import\s+(.+))?", re.M)
  root = os.path.join(_runs.ROOT, "jaxpipe")
  for folder, _, files in os.walk(root):
    for name in (n for n in files if n.endswith(".py")):
      text = open(os.path.join(folder, name)).read()
      assert "mallopt" not in text and "SCHED_IDLE" not in text, name
      for module, names in imports.findall(text):
        assert not module.startswith("tools") and "account" not in module + names, (name, module)
        if os.path.basename(folder) in ("pipeline", "model"):
          assert "accel" not in module + names, (name, module, names)


def test_no_hooks_by_default_and_a_bad_module_is_one_line():
  cfg = config_lib.load(_runs.TINY)
  assert cfg.run.launch_hooks == "" and launch.hooks(cfg) is None
  opts = ScheduleOptions()
  assert launch.schedule_options(cfg, "gpipe", opts) is opts
  assert launch.hooks(config_lib.load(_runs.TINY, [HOOKS])) is tuning
  with pytest.raises(ConfigError, match=r"^run.launch_hooks=tools.cpu.nope: cannot import it: "
                                        r".*tools.cpu.tuning is in a clone"):
    launch.hooks(config_lib.load(_runs.TINY, ["run.launch_hooks=tools.cpu.nope"]))


@pytest.mark.exit_status(2)
def test_train_py_refuses_hooks_it_cannot_import_in_one_line(tmp_path):
  p = _runs.run(str(tmp_path / "run"), "run.launch_hooks=no_such_hooks_module",
                cache_dir=str(tmp_path / "corpus"))
  assert p.returncode == 2, p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "run.launch_hooks=no_such_hooks_module: cannot import it" in lines[0]
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("old,new", [("run.cpu_malloc_arenas=one", "JAXPIPE_CPU_ARENAS"),
                                     ("run.cpu_split_ops=never", "JAXPIPE_CPU_SPLIT_OPS"),
                                     ("dist.idle_io_thread=false", "JAXPIPE_CPU_IO_THREAD")])
def test_the_old_cpu_keys_name_their_variables_and_saved_configs_drop_them(old, new):
  """A user's old key: one line naming the variable; a run's saved config with it still compares."""
  from jaxpipe import resume  # pylint: disable=g-import-not-at-top
  key, value = old.split("=")
  with pytest.raises(ConfigError, match=rf"^{re.escape(key)} moved: it is .*{new}.*"
                                        r"run.launch_hooks=tools.cpu.tuning"):
    config_lib.load(_runs.TINY, [old])
  cfg = config_lib.load(_runs.TINY)
  saved = config_lib.to_dict(cfg)
  section, name = key.split(".")
  saved[section] = {**saved[section], name: value}
  assert resume.config_differences(saved, config_lib.to_dict(cfg), allowed=frozenset()) == []
  assert config_lib.from_dict(config_lib.upgrade_saved(saved)) == cfg


def test_the_launch_calls_the_hooks_in_order(monkeypatch):
  """prepare (after XLA_FLAGS), backend_starting, backend_started; compile_scope reaches the schedule."""
  calls = []
  monkeypatch.setattr(tuning, "prepare", lambda cfg, n: calls.append(("prepare", n)))
  monkeypatch.setattr(tuning, "backend_starting", lambda: calls.append(("starting",)))
  monkeypatch.setattr(tuning, "backend_started",
                      lambda cfg, devices, num, pid: calls.append(("started", len(devices), num, pid)))
  monkeypatch.setattr(accel, "gpu_expected", lambda env=None: False)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  cfg = config_lib.load(_runs.TINY, [HOOKS, "pipeline.schedule=2bw", "pipeline.stages=2"])
  launch.prepare_devices(cfg)
  launch.start(cfg)
  assert calls == [("prepare", 2), ("starting",), ("started", len(jax.devices()), 1, 0)]
  assert launch.schedule_options(cfg, "1f1b", ScheduleOptions()).compile_scope \
      is tuning.compile_scope


def test_prepare_tunes_malloc_on_cpus_only(monkeypatch):
  """One arena where the process has one device, or as JAXPIPE_CPU_ARENAS says; nothing on GPUs."""
  tuned = []
  # Recorded, not applied: this test process keeps glibc's malloc as it is.
  monkeypatch.setattr(tuning, "tune_cpu_malloc",
                      lambda env=None, one_arena=True: tuned.append(one_arena))
  for gpu, env, devices, want in ((False, None, 2, [False]), (True, None, 2, []),
                                  (False, None, 1, [True]), (False, "one", 2, [True]),
                                  (False, "per_thread", 1, [False])):
    monkeypatch.setattr(accel, "gpu_expected", lambda env=None, gpu=gpu: gpu)
    if env is None:
      monkeypatch.delenv(tuning.ARENA_ENV, raising=False)
    else:
      monkeypatch.setenv(tuning.ARENA_ENV, env)
    tuned.clear()
    tuning.prepare(None, devices)
    assert tuned == want, (gpu, env, devices)
  monkeypatch.setenv(tuning.ARENA_ENV, "two")
  with pytest.raises(ConfigError, match="JAXPIPE_CPU_ARENAS must be one of auto, one, "
                                        "per_thread, got 'two'"):
    tuning.prepare(None, 1)


def test_backend_started_pins_compilation_only_where_every_core_runs_a_device(
    monkeypatch, clean_state):
  """`split_cpu_ops`' answer for the process's devices and cores decides whether
  `compiling` pins; JAXPIPE_CPU_SPLIT_OPS overrides it."""
  monkeypatch.setattr(tuning, "usable_cores", lambda: 2)
  devices = jax.devices()
  n = len(jax.local_devices())
  for env, cores, want_pinned in ((None, 2, n >= 2), (None, n + 1, False),
                                  ("always", 2, False), ("never", 16, True)):
    monkeypatch.setattr(tuning, "usable_cores", lambda cores=cores: cores)
    if env is None:
      monkeypatch.delenv(tuning.SPLIT_ENV, raising=False)
    else:
      monkeypatch.setenv(tuning.SPLIT_ENV, env)
    tuning.backend_started(None, devices, 1, 0)
    pinned = tuning._STATE["compile_cores"] is not None  # pylint: disable=protected-access
    assert pinned is want_pinned, (env, cores)


def test_one_malloc_arena_by_choice_and_devices():
  assert [tuning.one_malloc_arena(c, n) for c in ("auto", "one", "per_thread") for n in (1, 2)] \
      == [True, False, True, True, False, False]
  with pytest.raises(ValueError, match="malloc arenas must be one of auto, one, per_thread"):
    tuning.one_malloc_arena("threads", 1)


def test_malloc_tuning_yields_to_the_environment():
  for env in ({"MALLOC_ARENA_MAX": "2"}, {"MALLOC_TOP_PAD_": "131072"},
              {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
    assert tuning.tune_cpu_malloc(env) is None, env


def _faults_per_call(mode: str, t_mib: int) -> dict:
  """tools/cpu/bench_malloc.py's worker in a fresh process: t of t_mib MiB (a block of twice that), 5 calls.

  After the worker's default warm-up (12 calls).

  The process compiles its function: one that loads it from JAX's persistent
  cache was seen to take the faults again in one run out of three to six.
  """
  out = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "cpu", "bench_malloc.py"),
                        "--worker", json.dumps([t_mib, 5, mode])],
                       capture_output=True, text=True, check=True,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "JAX_COMPILATION",
                                                 "JAX_PERSISTENT"))})
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("t_mib", [16, 48], ids=["32 MiB block", "96 MiB block"])
def test_tuned_malloc_keeps_a_steps_buffers_for_the_next(t_mib):
  """A block over glibc's mmap threshold (32 MiB), and one over a thread arena's
  heap (64 MiB), which only one arena for every thread keeps."""
  import platform  # pylint: disable=g-import-not-at-top
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    pytest.skip("malloc is tuned on glibc only")
  plain = _faults_per_call("glibc defaults", t_mib)
  assert plain["tuned"] is None
  # glibc's defaults map the temporary block afresh each call (4 KiB a fault).
  assert plain["faults"] > t_mib * 2**20 * 2 / 4096 * 0.9, plain
  # Tuned as for a process of one device, it keeps it once the worker's 12
  # warm-up calls are past: until glibc's thread cache has filled, a block
  # can land on fresh heap (bench_malloc's memalign_walk). Under two busy
  # loops, 7 processes of 18 with 3 warm-up calls still took the faults a
  # call (median of 5); 0 of 32 with 12.
  tuned = _faults_per_call("tuned, one arena", t_mib)
  assert tuned["tuned"] == {k: v for k, (_, v) in {**tuning.CPU_MALLOC, **tuning.ONE_ARENA}.items()}
  assert tuned["faults"] < plain["faults"] / 20, (plain, tuned)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc and SCHED_IDLE")
def test_a_thread_waiting_in_epoll_is_found_and_made_idle_class():
  """gloo's event loop waits in epoll, XLA's threads on futexes: only the first is found."""
  import select  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  stop, ids = threading.Event(), {}
  poller = select.epoll()

  def in_epoll():
    ids["epoll"] = threading.get_native_id()
    while not stop.is_set():
      poller.poll(0.05)

  def on_futex():
    ids["futex"] = threading.get_native_id()
    stop.wait()

  threads = [threading.Thread(target=in_epoll), threading.Thread(target=on_futex)]
  for t in threads:
    t.start()
  try:
    while len(ids) < 2:
      stop.wait(0.01)
    assert ids["epoll"] in tuning.thread_ids() and ids["futex"] in tuning.thread_ids()
    assert tuning.epoll_threads({ids["epoll"], ids["futex"]}) == [ids["epoll"]]
    assert tuning.make_idle_class([ids["epoll"]]) == [ids["epoll"]]
    assert os.sched_getscheduler(ids["epoll"]) == os.SCHED_IDLE
    assert os.sched_getscheduler(ids["futex"]) == os.SCHED_OTHER
  finally:
    stop.set()
    for t in threads:
      t.join()
    poller.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU affinity")
def test_launcher_idles_the_io_thread_only_where_every_core_serves_a_device(monkeypatch, capsys):
  found, made = {}, []
  monkeypatch.setattr(tuning, "epoll_threads", lambda tids: sorted(found.get(frozenset(tids), [])))
  monkeypatch.setattr(tuning, "make_idle_class", lambda tids: made.extend(tids) or list(tids))
  found[frozenset({7, 8})] = [7]
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
  assert tuning.idle_io_thread({7, 8}, 1, 0) == [] and not made  # a spare core: left alone
  assert capsys.readouterr().err == ""
  assert tuning.idle_io_thread({7, 8}, 2, 0) == [7] and made == [7]
  assert "process 0: gloo's I/O thread 7 runs idle-class (2 cores for 2 devices" in (
      capsys.readouterr().err)
  # None or several in epoll: none is touched, and it says so.
  found[frozenset({8, 9})] = [8, 9]
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
  assert tuning.idle_io_thread({8, 9}, 1, 1) == [] and made == [7]
  assert tuning.idle_io_thread({5}, 1, 1) == [] and made == [7]
  err = capsys.readouterr().err
  assert "process 1: gloo's I/O thread left at the normal class (2 of" in err
  assert "(0 of the backend's new threads" in err


def test_split_cpu_ops_by_choice_devices_and_cores():
  # auto: split only where a core is left over beyond the process's devices.
  cases = ((1, 2), (2, 2), (4, 2), (1, 1), (2, 16))   # (devices, cores)
  assert [tuning.split_cpu_ops("auto", d, c) for d, c in cases] == [True, False, False, False, True]
  assert tuning.split_cpu_ops("auto", 2, None)  # cores unknown: XLA's own choice
  assert tuning.split_cpu_ops("always", 2, 2) and not tuning.split_cpu_ops("never", 1, 16)
  with pytest.raises(ValueError, match="split ops must be one of auto, always, never"):
    tuning.split_cpu_ops("no", 2, 2)


_SPLIT_PROBE = """
import os, json, jax, jax.numpy as jnp
import sys
sys.path.insert(0, os.environ["PROBE_ROOT"])
from tools.cpu import tuning
tuning.start_backend(split_ops=os.environ["PROBE_SPLIT"] == "1")
f = jax.jit(lambda x: jnp.tanh(x).T * 2.0 + x)
x = jnp.ones((1024, 1024))
outside = f.lower(x).compile().as_text()
import threading
cores = sorted(os.sched_getaffinity(0))
ready, stop, own = threading.Event(), threading.Event(), []
def narrow():  # a thread of its own narrower affinity keeps it
  os.sched_setaffinity(0, {cores[-1]})
  own.append(threading.get_native_id())
  ready.set()
  stop.wait()
t = threading.Thread(target=narrow)
t.start()
ready.wait()
with tuning.compiling():
  with tuning.compiling():  # nested: pinned once, restored once
    pass
  pinned = sorted(os.sched_getaffinity(0))
  inside = jax.jit(lambda x: jnp.tanh(x).T * 3.0 + x).lower(x).compile().as_text()
try:
  with tuning.compiling():
    raise KeyError("while compiling")
except KeyError:
  pass
mine = sorted(os.sched_getaffinity(own[0]))
stop.set()
t.join()
import time
for _ in range(500):  # a joined thread can stay listed a moment while the kernel reaps it
  if str(own[0]) not in os.listdir("/proc/self/task"):
    break
  time.sleep(0.01)
after = set()
for tid in os.listdir("/proc/self/task"):
  try:
    after.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
  except OSError:  # a thread that ended meanwhile
    pass
key = 'outer_dimension_partitions":["2"]'
print(json.dumps({"outside": outside.count(key), "inside": inside.count(key),
                  "after": sorted(after), "cores": cores, "pinned": pinned, "narrow": mine}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or shutil.which("taskset") is None,
                    reason="needs Linux's CPU affinity, taskset and two cores")
def test_compiling_without_split_ops_gives_xla_one_core_and_the_threads_theirs_back():
  """On two cores XLA splits a large elementwise operation in two; after
  `start_backend(split_ops=False)`, what is compiled inside `compiling()` is
  not split, what is compiled outside still is, and every thread ends with the
  cores it had (a nested use and an exception inside included)."""
  cores = sorted(os.sched_getaffinity(0))[:2]
  out = {}
  for split in ("1", "0"):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PROBE_SPLIT": split, "PROBE_ROOT": _runs.ROOT,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # JAX's persistent cache does not key on the threads: one run's program
    # would be the other's.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c",
                        _SPLIT_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out[split] = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["1"]["outside"] >= 1 and out["1"]["inside"] >= 1  # XLA splits by default
  assert out["0"]["outside"] >= 1 and out["0"]["inside"] == 0
  assert out["0"]["pinned"] == [cores[0]] and out["1"]["pinned"] == cores
  for r in out.values():
    assert r["after"] == [r["cores"]] and r["cores"] == cores
    assert r["narrow"] == [cores[-1]]  # its own cores back, not the process's


def test_a_schedule_compiles_its_step_inside_its_compile_scope_once_per_kind():
  """`Schedule.step`'s first call of each kind (plain, guarded) compiles, inside
  `ScheduleOptions.compile_scope`; later calls run the compiled step outside it; a
  lowered step's `compile()` is inside it too."""
  from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import ScheduleOptions, make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
  entered = []

  @contextlib.contextmanager
  def counting():
    entered.append(1)
    yield

  m = 4
  sch = make_schedule("2bw", util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), m,
                      ScheduleOptions(stash="residuals", compile_scope=counting))
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params()), (m, util.ROWS, util.SEQ))
  tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in util.batches(m)[0])
  for _ in range(3):
    state, _ = sch.step(state, tok, tgt)
  assert len(entered) == 1
  state, _ = sch.step(state, tok, tgt, go=jnp.asarray(True))
  state, _ = sch.step(state, tok, tgt, go=jnp.asarray(True))
  assert len(entered) == 2
  sch.lower_step(state, tok, tgt).compile()
  assert len(entered) == 3
  jax.block_until_ready(state)


def test_the_benchmarks_schedules_get_the_tunings_options(monkeypatch, clean_state):
  """The CPU benchmarks' configs name the tuning's hooks: on CPUs gpipe and zb1 keep
  their rings in the state, and every schedule compiles in the tuning's scope."""
  sys.path.insert(0, os.path.join(_runs.ROOT, "tools", "cpu"))
  import bench_common  # pylint: disable=g-import-not-at-top
  shape = bench_common.ModelShape()
  tuning._STATE["cpu"] = True  # pylint: disable=protected-access
  for name, rings in (("gpipe", True), ("zb1", True), ("1f1b", False), ("2bw", False)):
    cfg = bench_common.make_config(shape, name, 2, 4)
    opts = launch.schedule_options(cfg, name, ScheduleOptions())
    assert opts.rings_in_state is rings and opts.compile_scope is tuning.compile_scope, name
  tuning._STATE["cpu"] = False  # pylint: disable=protected-access
  cfg = bench_common.make_config(shape, "gpipe", 2, 4)
  assert not launch.schedule_options(cfg, "gpipe", ScheduleOptions()).rings_in_state
