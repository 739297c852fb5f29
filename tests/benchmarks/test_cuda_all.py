"""``benchmarks/cuda_all.sh``, the GPU's one entry point, on the CPU: its dry run end to end, and the choices of
``benchmarks/cuda_slices.py`` (which slice runs next, what is done, the stamps, the docs' table) on known input.

The dry run (``DEVICE=cpu``) works in a copy of the checkout: the test holds what it wrote there to be unchanged
in the checkout. ``SMOKE=1`` (the default run) checks each measurement's commands instead of running them and
collects the CUDA tests; a first call skips two slices (``SKIP``), the next goes on from its ``tree.dry-run.tgz``
with those, and a third runs nothing. The fuller dry run (``-m slow``) runs every measurement small.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import cuda_slices as S
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cuda_all.sh"
NAMES = [s.name for s in S.SLICES]


def dry_run(out: Path, seconds: int, smoke: bool, timeout: int, skip: str = "") -> tuple[list[str], str]:
    """One dry call: the slices it ran, and its output."""
    env = {**os.environ, "DEVICE": "cpu", "SMOKE": "1" if smoke else "0", "SKIP": skip}
    env.pop("COMMIT", None)
    done = subprocess.run(["bash", str(SCRIPT), str(out), str(seconds)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"the dry run failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    return re.findall(r"\) (\w+) \(at most \d+ s\)", done.stdout), done.stdout


def dry_state(out: Path) -> dict[str, dict]:
    with tarfile.open(out / "tree.dry-run.tgz") as tar:
        return json.load(tar.extractfile(S.STATE.as_posix()))["slices"]


def check_dry_calls(tmp_path: Path, smoke: bool, seconds: int, timeout: int, skip: str = "") -> list[list[str]]:
    """Dry calls into one OUT_DIR (the first one skipping ``skip``; at most three) until every slice is done: every
    slice runs once (the CUDA tests first; again only where the code changed meanwhile), the results accumulate in
    tree.dry-run.tgz, and nothing the dry run wrote reaches the checkout. The slices each call ran."""
    before, code = S.fingerprint(ROOT), S.code_hash(ROOT)
    out = tmp_path / "out"
    calls = []
    for call in range(3):
        calls.append(dry_run(out, seconds, smoke, timeout, skip if call == 0 else "")[0])
        if (out / "tree.dry-run.tgz").is_file() and set(dry_state(out)) == set(NAMES):
            break
    ran = [name for call in calls for name in call]
    assert ran and ran[0] == "cuda_tests", f"the CUDA tests did not come first: {calls}"
    if ran.count("cuda_tests") == 2 and S.code_hash(ROOT) != code:  # the package or the tests changed meanwhile
        ran.remove("cuda_tests")
    assert sorted(ran) == sorted(NAMES), f"slices run by each call: {calls}; every slice once: {NAMES}"
    state = dry_state(out)
    assert set(state) == set(NAMES) and all(e["state"] == "done" and e["dry_run"] for e in state.values()), state
    assert "collected" in state["cuda_tests"]["detail"], state["cuda_tests"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "status.txt", "tree.dry-run.tgz"]
    with tarfile.open(out / "logs.tgz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {f"{n}.log" for n in ran} <= logs, logs  # every call's logs, kept in the OUT_DIR
    with tarfile.open(out / "tree.dry-run.tgz") as tar:  # what it wrote, by path: the hash of its bytes
        files = [member for member in tar.getmembers() if member.isfile()]
        written = {f.name: hashlib.sha256(tar.extractfile(f).read()).hexdigest() for f in files}
    assert S.STATE.as_posix() in written and "docs/benchmarks/index.md" in written, written
    after = S.fingerprint(ROOT)  # (others may edit the checkout meanwhile: only the dry run's own bytes count)
    reached = [path for path, digest in written.items() if after.get(path) == digest != before.get(path)]
    assert not reached, f"what the dry run wrote in its copy reached the checkout: {reached}"
    return calls


@pytest.mark.slow  # three calls of the script; its refusals are held by default in this file
def test_the_dry_run_goes_end_to_end_in_a_copy_and_resumes(tmp_path: Path) -> None:
    calls = check_dry_calls(tmp_path, smoke=True, seconds=60, timeout=240, skip="suite_quality quality_at_scale")
    assert "quality_at_scale" not in calls[0] and "quality_at_scale" in calls[1], calls  # the next call goes on
    assert dry_run(tmp_path / "out", 60, smoke=True, timeout=240)[0] == [], f"a call after {calls} ran slices again"


@pytest.mark.slow
def test_the_full_dry_run_runs_every_measurement_small(tmp_path: Path) -> None:
    check_dry_calls(tmp_path, smoke=False, seconds=1800, timeout=2400)
    with tarfile.open(tmp_path / "out" / "tree.dry-run.tgz") as tar:
        names = set(tar.getnames())
        deepspeed = tar.extractfile("docs/deepspeed.md").read().decode()
    assert {"docs/optimizer.md", "docs/deepspeed.md", "benchmarks/runs/deepspeed_memory_cpu.json"} <= names, names
    assert any(n.startswith("benchmarks/runs/quality_at_scale/tiny/") for n in names), names
    body = S.sections(deepspeed)["deepspeed_memory_cpu"]  # the section it wrote, stamped as a dry run's
    assert body.startswith("*Measured on cpu (dry run) at commit "), body[:200]


def test_without_a_gpu_or_device_cpu_it_refuses_and_changes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # no GPU here, whatever this machine has
    (tmp_path / "nvidia-smi").chmod(0o755)
    env["CUDA_VISIBLE_DEVICES"] = ""
    before = S.fingerprint(ROOT)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "60"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "DEVICE=cpu" in done.stdout, done.stdout + done.stderr
    assert S.fingerprint(ROOT) == before


# ------------------------------------------------------------------------------------------ the script's parts


def test_every_slice_has_its_function_in_the_script_and_only_those() -> None:
    functions = re.findall(r"^slice_(\w+)\(\)", SCRIPT.read_text(), re.M)
    assert sorted(functions) == sorted(NAMES)


def test_the_cuda_tests_the_script_runs_exist() -> None:
    tests = re.search(r"^TESTS=\((.*?)\)", SCRIPT.read_text(), re.M | re.S).group(1).split()
    assert len(tests) >= 8
    assert S.check_command(ROOT, ["python3", "-m", "pytest", *tests]) == []
    assert S.check_command(ROOT, ["python3", "-m", "pytest", "tests/optim/test_graph_step.py::test_nope"]) != []


def test_a_command_with_a_flag_its_script_does_not_take_is_caught() -> None:
    ok = ["python3", "benchmarks/step_time.py", "--device", "cuda", "--shapes", "ragged", "--quick"]
    assert S.check_command(ROOT, ok) == []
    assert S.check_command(ROOT, ok + ["--nope"]) == ["benchmarks/step_time.py: no flag --nope"]
    assert S.check_command(ROOT, ["python3", "benchmarks/sgd_lion.py", "--seeds", "0", "--accelerator", "cpu"]) == []
    assert S.check_command(ROOT, ["python3", "benchmarks/nope.py"]) == ["benchmarks/nope.py: no such script"]


# ------------------------------------------------------------------------------------------ the choices


def entry(state: str = "done", dry_run: bool = False, **more: object) -> dict:
    e = {"state": state, "device": "NVIDIA H100 80GB HBM3", "commit": "0123abc", "date": "2026-01-01", "seconds": 10,
         **more}
    return {**e, "dry_run": True} if dry_run else e


def test_done_slices_are_settled_and_the_tests_run_again_when_the_code_changed() -> None:
    state = {"cuda_tests": entry(code="aaa"), "step_time_gpt2": entry(), "offload_schedule": entry("partial"),
             "step_time_ragged": entry(dry_run=True), "step_time_many": entry("failed")}
    names = [s.name for s in S.pending(state, "aaa", dry_run=False)]
    assert names[:4] == ["offload_schedule", "step_time_ragged", "step_time_many", "deepspeed_memory"]
    assert "cuda_tests" not in names and "step_time_gpt2" not in names
    assert [s.name for s in S.pending(state, "bbb", dry_run=False)][0] == "cuda_tests"  # the code changed
    assert "step_time_ragged" not in [s.name for s in S.pending(state, "aaa", dry_run=True)]  # dry, for dry runs
    redo = [s.name for s in S.pending(state, "aaa", False, redo={"step_time_gpt2"}, skip={"offload_schedule"})]
    assert "step_time_gpt2" in redo and "offload_schedule" not in redo


def test_the_tests_come_first_and_gate_the_rest_and_a_slice_that_does_not_fit_waits() -> None:
    todo = list(S.SLICES)
    chosen, limit, _ = S.next_slice(todo, {}, left=500, dry_run=False, smoke=False, gate=True)
    assert chosen.name == "cuda_tests" and limit == S.BY_NAME["cuda_tests"].cap
    assert S.next_slice(todo, {}, left=100, dry_run=False, smoke=False, gate=True)[0] is None  # the tests do not fit
    assert S.next_slice(todo, {"cuda_tests": "failed"}, 500, False, False, gate=True)[0] is None
    assert S.next_slice(todo, {"cuda_tests": "failed"}, 500, False, False, gate=False)[0].name == "step_time_gpt2"
    # 200 s left after the tests: step_time_gpt2 (150 s) runs; then with 100 s offload (360 s) waits, ragged runs
    assert S.next_slice(todo, {"cuda_tests": "done"}, 200, False, False, True)[:2] == (S.BY_NAME["step_time_gpt2"], 200)
    chosen, _, waiting = S.next_slice(todo, {"cuda_tests": "done", "step_time_gpt2": "done"}, 100, False, False, True)
    assert chosen.name == "step_time_ragged" and waiting == ["offload_schedule: needs 360 s, 100 s left"]
    quality = S.next_slice([S.BY_NAME["quality_at_scale"]], {}, 900, False, False, True)
    assert quality[1] == 900  # a resumable slice takes what is left


def test_a_slice_stamps_the_sections_it_wrote_and_no_other() -> None:
    before = ("<!-- a_cuda:start -->\n*Measured on X at commit 1, d.*\n\nold\n<!-- a_cuda:end -->\n"
              "<!-- b:start -->\nkept\n<!-- b:end -->\n<!-- gpu_status_x:start -->\ns\n<!-- gpu_status_x:end -->\n")
    after = before.replace("*Measured on X at commit 1, d.*\n\nold", "new").replace("\ns\n", "\nt\n")
    line = "*Measured on NVIDIA H100 at commit 0123abc, 2026-01-01 (`benchmarks/cuda_all.sh`, slice `x`).*"
    stamped = S.stamp(after, before, line)
    assert S.sections(stamped) == {"a_cuda": f"{line}\n\nnew\n", "b": "kept\n", "gpu_status_x": "t\n"}
    assert S.stamp(before, before, line) == before


def test_the_docs_say_what_the_state_file_says(tmp_path: Path) -> None:
    for feature in S.FEATURES:
        page = tmp_path / "docs" / feature.page
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"# P\n\n<!-- gpu_status_{feature.key}:start -->\n<!-- gpu_status_{feature.key}:end -->\n")
    (tmp_path / "docs" / S.INDEX).write_text("# I\n\n<!-- cuda_slices:start -->\n<!-- cuda_slices:end -->\n")
    state = {"cuda_tests": entry(code="c", detail="71 passed"), "step_time_gpt2": entry(),
             "deepspeed_memory": entry("unavailable", detail="deepspeed is not installed")}
    S.render(tmp_path, state)
    index = (tmp_path / "docs" / S.INDEX).read_text()
    assert "| done on NVIDIA H100 80GB HBM3 at commit 0123abc, 2026-01-01 (71 passed) |" in index
    assert index.count("| not run yet |") == len(S.SLICES) - 3
    optimizer = (tmp_path / "docs" / "optimizer.md").read_text()
    graph = S.sections(optimizer)["gpu_status_graph_step"]
    assert graph.startswith("**The CUDA graph step:** ran on a GPU: slice `cuda_tests` done on NVIDIA H100"), graph
    assert "ran in part on a GPU" in S.sections(optimizer)["gpu_status_offload"]
    assert "not yet run on a GPU" in S.sections(optimizer)["gpu_status_amp_scaling"]
    assert "not run: deepspeed is not installed" in (tmp_path / "docs" / "deepspeed.md").read_text()
    with pytest.raises(ValueError, match="outcome='nope'"):
        S.record({}, "x", "nope", "", 0, "d", "c", "t", "h", False)
