"""Replays of the recorded trajectories of tests/trajectories.py (issue 58: the proof that a reshaping changed
nothing). Where this environment's fingerprint is the record's, every scenario must replay bit for bit (every
parameter and optimizer-state tensor after every step, every loss); elsewhere within the named tolerances of
``trajectories.REPLAY_RTOL``, and the test says so (a ``ReplayToleranceWarning`` and the property ``comparison``).

Companions: a replay with the learning rate one ulp larger, or one step more or fewer, or another solver setting,
fails the bitwise comparison; a learning rate 1% larger fails the tolerance comparison too. The inductor scenarios
are slow (``-m slow``); read the module docstring of tests/trajectories.py for how a reshaping commit uses this.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import trajectories as T


@functools.cache
def _record(group: str):
    return T.load(group)


@functools.cache
def _inductor_unavailable() -> str:
    """Why inductor cannot compile here ("" when it can): a trivial function compiled, independent of the library
    (so that a compile failure caused by a change of the library fails its scenario instead of skipping it)."""
    try:
        torch._dynamo.reset()
        out = torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(3))
        return "" if torch.equal(out, torch.full((3,), 3.0)) else f"a trivial compiled function returned {out}"
    except Exception as err:  # noqa: BLE001 - any failure means no compiler here
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        torch._dynamo.reset()


def _scenario_params():
    for name, scenario in T.SCENARIOS.items():
        yield pytest.param(name, marks=[pytest.mark.slow] if scenario.slow else [], id=name)


@pytest.mark.parametrize("name", list(_scenario_params()))
def test_the_scenario_replays_its_record(name, record_property):
    """Bit for bit where the fingerprint is the record's (and the final tensors equal the committed ones exactly);
    else the final parameters and losses within the tolerances, with a warning that says so."""
    scenario = T.SCENARIOS[name]
    doc, finals = _record(scenario.group)
    assert name in doc["scenarios"], f"{name} is not recorded: python tests/trajectories.py record {scenario.group}"
    if scenario.run.compile == "inductor" and _inductor_unavailable():
        pytest.skip(f"inductor cannot compile on this machine ({_inductor_unavailable()})")
    replay = scenario.run()
    assert replay.threads == T.THREADS
    mode, why = T.comparison_mode(doc["fingerprint"], T.fingerprint())
    record_property("comparison", mode)
    recorded = doc["scenarios"][name]
    if mode == "bitwise":
        assert T.bitwise_mismatches(recorded, replay) == []
        assert replay.final.keys() == finals[name].keys()
        assert all(torch.equal(replay.final[k], finals[name][k]) for k in finals[name])
    else:
        warnings.warn(T.ReplayToleranceWarning(f"{name}: compared within tolerances, not bit for bit, because the "
                                               f"environment differs from the record's: {why}"), stacklevel=1)
        assert T.tolerance_mismatches(recorded, finals[name], replay, scenario.run.compute_dtype,
                                      scenario.tolerances) == []


def test_the_records_hold_every_scenario_and_nothing_else():
    """Each group's record holds exactly its scenarios (a scenario added without recording, or one removed, fails
    here), their final tensors, and the fingerprint the replay decides by, recorded on one thread."""
    for group in T.GROUPS:
        doc, finals = _record(group)
        names = {n for n, s in T.SCENARIOS.items() if s.group == group}
        assert set(doc["scenarios"]) == names and set(finals) == names, group
        assert doc["fingerprint"].keys() == T.fingerprint().keys() and doc["fingerprint"]["threads"] == 1
        assert all(s["threads"] == 1 for s in doc["scenarios"].values())
    assert {s.group for s in T.SCENARIOS.values()} == set(T.GROUPS)


def test_the_comparison_mode_follows_the_fingerprint():
    here = T.fingerprint()
    assert T.comparison_mode(here, dict(here)) == ("bitwise", "")
    mode, why = T.comparison_mode({**here, "cpu_capability": "NO-SUCH-ISA"}, here)
    assert mode == "tolerance" and "cpu_capability: recorded 'NO-SUCH-ISA'" in why


# ------------------------------------------------------------------------------ companions: a change is caught
@functools.cache
def _base(name: str) -> T.Trajectory:
    return T.SCENARIOS[name].run()


def test_a_second_run_in_the_same_process_is_bitwise_equal():
    """The property every replay relies on, here without the record: the same scenario twice gives the same
    digests (a scenario that read global state, e.g. the global RNG or the thread count, would fail here)."""
    for name in ("adam-f64", "muon-f64", "adam-bf16-master", "transformer-encoder"):
        assert T.bitwise_mismatches(_base(name).record(), T.SCENARIOS[name].run()) == [], name


@pytest.mark.parametrize(("name", "overrides", "first"), [
    ("adam-f64", {"lr": math.nextafter(1e-2, 1.0)}, 1),  # one float64 ulp
    ("adam-f64-capturable", {"lr": math.nextafter(1e-2, 0.0)}, 1),
    ("adam-bf16-master", {"lr": 1e-2 * (1 + 2.0 ** -23)}, 1),  # one float32 ulp
    ("muon-f64", {"lr": math.nextafter(1e-2, 1.0)}, 1),
    ("muon-f64", {"direction_steps": 2}, 1),  # another solver setting
    ("gpt2-qk-bias-drop", {"lr": 1e-2 * (1 + 2.0 ** -23)}, 1),
    ("llama-gqa-gain", {"lr": 1e-2 * (1 + 2.0 ** -23)}, 1),
])
def test_a_perturbed_replay_fails_the_bitwise_comparison(name, overrides, first):
    """A learning rate one ulp off (or another solver setting) changes the trajectory from the first step on,
    and the bitwise comparison names that state and the tensors that differ; within the cross-machine tolerances
    the one-ulp change is invisible, which is why a reshaping is held to the bitwise comparison."""
    scenario = T.SCENARIOS[name]
    base, perturbed = _base(name), scenario.run(**overrides)
    found = T.bitwise_mismatches(base.record(), perturbed)
    assert any(f"first the state after step {first} " in m for m in found), found
    if "lr" in overrides:
        assert T.tolerance_mismatches(base.record(), base.final, perturbed, scenario.run.compute_dtype,
                                      scenario.tolerances) == []


@pytest.mark.parametrize("extra", [1, -1])
def test_a_replay_with_one_step_more_or_fewer_fails(extra):
    scenario = T.SCENARIOS["adam-f64"]
    other = scenario.run(steps=scenario.run.steps + extra)
    found = T.bitwise_mismatches(_base("adam-f64").record(), other)
    assert any("states replayed against" in m for m in found) and any("losses differ" in m for m in found), found
    found = T.tolerance_mismatches(_base("adam-f64").record(), _base("adam-f64").final, other, torch.float64)
    assert any("steps replayed against" in m for m in found), found


@pytest.mark.parametrize("name", ["adam-f64", "adam-f32", "adam-bf16-master", "muon-f64", "transformer-encoder"])
def test_a_learning_rate_one_percent_larger_fails_the_tolerance_comparison(name):
    """The tolerance comparison (another machine) is not vacuous: a real change of the run exceeds it."""
    scenario = T.SCENARIOS[name]
    base = _base(name)
    found = T.tolerance_mismatches(base.record(), base.final, scenario.run(lr=1.01e-2), scenario.run.compute_dtype,
                                   scenario.tolerances)
    assert any(m.startswith("final frame") or ".parametrizations." in m for m in found), found


def test_a_change_of_optimizer_state_alone_is_named():
    """Parameters equal but one state entry different (e.g. a second moment stored otherwise): the bitwise
    comparison names that entry and the first state where it differs."""
    base = _base("adam-f64")
    label = "frame2 (2, 12, 12):exp_avg_sq"
    i = base.labels.index(label)
    altered = T.Trajectory(list(base.labels), [list(row) for row in base.digests], list(base.losses), base.final,
                           list(base.warnings))
    for row in altered.digests[3:]:
        row[i] = T.digest(torch.zeros(2, 1, 1, dtype=torch.float64))
    found = T.bitwise_mismatches(base.record(), altered)
    assert found == [f"6 state(s) differ, first the state after step 3 (0: before the first step), in [{label!r}]"]


def test_a_warning_of_the_library_is_recorded_and_its_absence_is_a_mismatch():
    """The recorded scenarios raise no warning (empty lists); a run that does (StiefelAdam given no frame says so
    at construction) has it in its trajectory, and against a record without it the comparison fails."""
    warned = T.FrameRun(T.StiefelAdam, (), steps=2)()
    assert warned.warnings == ["UserWarning"]
    quiet = T.Trajectory(warned.labels, warned.digests, warned.losses, warned.final, [])
    assert T.bitwise_mismatches(quiet.record(), warned) == ["warnings: replayed ['UserWarning'], recorded []"]


def test_the_bfloat16_tolerance_is_one_ulp():
    """Entry by entry: one bfloat16 ulp apart passes, two fail."""
    a = torch.tensor([0.3, -0.07, 1.5], dtype=torch.bfloat16)
    one = a.view(torch.int16).add(1).view(torch.bfloat16)
    two = a.view(torch.int16).add(2).view(torch.bfloat16)
    assert T.tensor_mismatch(one, a) is None
    assert "more than one ulp" in T.tensor_mismatch(two, a)


# ------------------------------------------------------------------------------ another kernel set
#: Scenarios replayed by a subprocess with ``ATEN_CPU_CAPABILITY=default`` (torch's kernels without SIMD: other
#: reductions, so other rounding) and ``MKL_CBWR=COMPATIBLE`` (MKL's code path for any x86 CPU): one per dtype and
#: optimizer, and those that measured the largest differences (muon-direction-capped, muon-f32-capturable, the encoder).
OTHER_KERNELS = ["adam-f64", "adam-f32", "adam-bf16-master", "adam-bf16", "muon-f64", "muon-direction-capped",
                 "muon-f32-capturable", "muon-bf16-master", "transformer-encoder"]

_REPLAY_ELSEWHERE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch, trajectories as T
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for name in sys.argv[2:]:
    s = T.SCENARIOS[name]
    doc, finals = T.load(s.group)
    replay = s.run()
    rec = doc["scenarios"][name]
    out[name] = {"mode": T.comparison_mode(doc["fingerprint"], T.fingerprint())[0],
                 "bitwise": T.bitwise_mismatches(rec, replay) == [],
                 "tolerance": T.tolerance_mismatches(rec, finals[name], replay, s.run.compute_dtype, s.tolerances)}
print(json.dumps(out))
"""


def test_another_kernel_set_replays_within_the_tolerances(record_property):
    """The tolerance mode does what it is for: replayed with torch's non-SIMD kernels and MKL's generic code path
    (what another CPU gives), the fingerprint differs, and the final tensors and losses agree within the named
    tolerances."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    proc = subprocess.run([sys.executable, "-c", _REPLAY_ELSEWHERE, str(root), *OTHER_KERNELS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["capability"] == T.fingerprint()["cpu_capability"]:
        pytest.skip(f"this CPU's kernels are already torch's default ones ({out['capability']}): no other set")
    assert all(out[n]["mode"] == "tolerance" for n in OTHER_KERNELS)
    assert {n: out[n]["tolerance"] for n in OTHER_KERNELS} == {n: [] for n in OTHER_KERNELS}
    record_property("bitwise_anyway", [n for n in OTHER_KERNELS if out[n]["bitwise"]])
