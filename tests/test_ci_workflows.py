"""A broken CI matrix fails here, not on the runner: schema-check every workflow and pin its shape."""

import pathlib
import shutil
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / "ci" / "workflows").glob("*.yml"))


def load(name):
    return yaml.safe_load((ROOT / "ci" / "workflows" / name).read_text())


def test_every_workflow_matches_the_github_workflow_schema():
    assert {p.name for p in WORKFLOWS} == {"cpu.yml", "gpu.yml", "trainium.yml"}
    exe = shutil.which("check-jsonschema") or str(pathlib.Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("name: x\non: push\njobs:\n  a:\n    steps:\n      - run: true\n")  # no runs-on
    exe = shutil.which("check-jsonschema") or str(pathlib.Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(broken)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0


def test_cpu_job_runs_the_same_script_as_ci_and_every_backend():
    jobs = load("cpu.yml")["jobs"]
    assert any(step.get("run") == "bash .ci/run" for step in jobs["tests"]["steps"])
    assert jobs["conformance"]["strategy"]["matrix"]["backend"] == ["reference", "triton", "nki"]


def test_gpu_and_trainium_jobs_run_on_their_self_hosted_runners():
    gpu = load("gpu.yml")["jobs"]["cuda"]
    trn = load("trainium.yml")["jobs"]["trainium"]
    assert "self-hosted" in gpu["runs-on"] and "gpu" in gpu["runs-on"]
    assert any("--backend triton" in s.get("run", "") for s in gpu["steps"])
    # one job per Trainium instance type, each on its own runner, targeting its own NeuronCore
    assert trn["strategy"]["matrix"]["instance"] == ["trn2", "trn3"]
    assert trn["strategy"]["fail-fast"] is False
    assert "self-hosted" in trn["runs-on"] and "${{ matrix.instance }}" in trn["runs-on"]
    assert trn["env"]["NEURON_PLATFORM_TARGET_OVERRIDE"] == "${{ matrix.instance }}"
    trn_runs = [s.get("run", "") for s in trn["steps"]]
    joined = " ".join(trn_runs)
    # the Neuron SDK 2.33: torch-neuronx 2.14 (the native neuron device), NKI 0.7 and the compiler
    assert all(pin in joined for pin in ('"torch-neuronx==2.14.*"', '"nki==0.7.*"', '"neuronx-cc==2.*"'))
    conformance = next(s for s in trn["steps"] if "portable_ops.conformance" in s.get("run", ""))
    assert "--backend nki --device neuron --strict" in conformance["run"]
    assert conformance["env"]["PORTABLE_OPS_STRICT"] == "1"
    assert any(r.startswith(".venv/bin/python -m pytest") and "tests/test_nki_*.py" in r for r in trn_runs)
    assert any(r.startswith(".venv/bin/python -m portable_ops.bench nki") for r in trn_runs)
    upload = next(s for s in trn["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "${{ matrix.instance }}" in upload["with"]["name"] and "nki.json" in upload["with"]["path"]
    for workflow in WORKFLOWS:
        for name, job in yaml.safe_load(workflow.read_text())["jobs"].items():
            assert "timeout-minutes" in job, f"{workflow.name}:{name} has no timeout"


def test_ci_script_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in readme.splitlines() if "pip install" in line and "[test]" in line)
    # Each of the command's steps, in order (one a line or chained with &&), with the linter before the tests.
    steps = [step.strip() for line in script.splitlines() if not line.lstrip().startswith("#")
             for step in line.split("&&")]
    remaining = iter(steps)
    assert all(step.strip() in remaining for step in command.split("&&")), (command, steps)
    assert steps[-1] == "python -m pytest" and "ruff check ." in steps
