"""`pytest --compile-times N`: where a test run's time goes to compiling.

Where does a test's time go: compiling (Mosaic, Triton and XLA) or
running? (It found XLA's GPU autotuner behind most of the GPU suite's
time, tests/conftest.py.) With the option, each test's call records the
seconds JAX reports (`jax.monitoring`) for tracing, lowering to MLIR and the
backend's compile, and how many compilations the persistent cache served;
the terminal summary lists the N tests with the most compile time and the
run's totals beside its test time. The records travel in the reports'
`user_properties`, so pytest-xdist's workers report them too.

Mosaic GPU kernels: were they compiled when their custom call first runs,
this report could not see it. On the H200 (JAX 0.11.2,
`benchmarks.diagnostics.compile_probe`, results/h200_compile_probe.txt:
bf16, head_dim 128, seq 128-1024) a jitted forward's or forward+VJP's
first run took no longer than its second (under 5 ms, after 1-4 s of
compile), so their compile falls within XLA's compile phase, which this
report sums.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import pytest

# JAX's duration events (jax._src.dispatch), by the phase they time.
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_PROPERTY = "compile_seconds"


@dataclasses.dataclass
class _Clock:
  """Seconds per phase, and persistent-cache hits, since the last reset."""
  seconds: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  cache_hits: int = 0

  def on_duration(self, event, duration, **_):
    if phase := _PHASES.get(event):
      self.seconds[phase] += duration

  def on_event(self, event, **_):
    if event == _CACHE_HIT:
      self.cache_hits += 1

  def take(self) -> dict:
    record = dict(self.seconds, cache_hits=self.cache_hits)
    self.seconds.clear()
    self.cache_hits = 0
    return record


def pytest_addoption(parser):
  parser.addoption(
      "--compile-times", type=int, default=0, metavar="N",
      help="record JAX's tracing, lowering and compile seconds per test and "
           "list the N tests that compile longest (0: off)")


def pytest_configure(config):
  if config.getoption("--compile-times"):
    clock = _Clock()
    jax.monitoring.register_event_duration_secs_listener(clock.on_duration)
    jax.monitoring.register_event_listener(clock.on_event)
    config.stash[_CLOCK] = clock


_CLOCK = pytest.StashKey[_Clock]()
# (node id, call seconds, record) of each test's call, as reported here: by
# every test in one process, by the workers' reports in xdist's controller.
_RECORDS: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  clock = item.config.stash.get(_CLOCK, None)
  if clock is not None:
    clock.take()  # what setup compiled belongs to no call
  yield
  if clock is not None:
    item.user_properties.append((_PROPERTY, clock.take()))


def pytest_runtest_logreport(report):
  if report.when != "call":
    return
  for name, record in report.user_properties:
    if name == _PROPERTY:
      _RECORDS.append((report.nodeid, report.duration, record))


def _compile_seconds(record: dict) -> float:
  """A record's trace, lower and compile seconds together."""
  return sum(record.get(phase, 0.0) for phase in _PHASES.values())


def pytest_terminal_summary(terminalreporter, config):
  most = config.getoption("--compile-times")
  records = _RECORDS
  if not most or not records:
    return
  write = terminalreporter.write_line
  total = collections.Counter()
  for _, _, record in records:
    total.update(record)
  test_seconds = sum(duration for _, duration, _ in records)
  compile_seconds = _compile_seconds(total)
  terminalreporter.section(f"compile time, {len(records)} tests")
  share = compile_seconds / max(test_seconds, 1e-9)
  write(f"tests' calls {test_seconds:.0f} s; of that JAX traced "
        f"{total['trace']:.0f} s, lowered {total['lower']:.0f} s, compiled "
        f"{total['compile']:.0f} s: the three {share:.0%} of the calls; "
        f"persistent-cache hits {total['cache_hits']}")
  ranked = sorted(records, key=lambda r: -_compile_seconds(r[2]))
  for nodeid, duration, record in ranked[:most]:
    spent = _compile_seconds(record)
    write(f"{spent:7.1f} s of {duration:6.1f} s  compile "
          f"{record.get('compile', 0.0):6.1f}  lower "
          f"{record.get('lower', 0.0):5.1f}  hits "
          f"{record.get('cache_hits', 0):3d}  {nodeid}")
