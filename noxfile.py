"""Test, lint and benchmark sessions for the offload monorepo.

Run ``nox -s tests`` for the CPU suite of every package, ``nox -s gpu_tests`` on a CUDA
machine, ``nox -l`` for the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
# Order matters only for readability: dependencies point down this list.
PACKAGES = ["solver", "trace", "runtime", "optim", "gpt-example"]
PACKAGE_DIRS = [f"packages/offload-{name}" for name in PACKAGES]
TEST_DIRS = [f"{d}/tests" for d in PACKAGE_DIRS]
# The benchmark scripts' own tests: CPU only.
BENCH_TEST_DIR = "benchmarks/tests"
# The README's commands, run and checked against the output it shows.
DOC_TEST_DIR = "tests"
SRC_DIRS = [f"{d}/src" for d in PACKAGE_DIRS]
TEST_TOOLS = ["pytest", "pytest-xdist", "hypothesis"]
# Test dependencies that need torch: not in the solver-only environment.
TORCH_TEST_TOOLS = ["peft"]  # LoRA models (offload-optim's test_frozen.py)

nox.options.sessions = ["tests", "solver_only", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True


def _install_all(session: nox.Session, *extra: str) -> None:
    """Install every package editable, torch pinned to the CPU build."""
    editable = [arg for d in PACKAGE_DIRS for arg in ("-e", d)]
    session.install("-c", CONSTRAINTS, *editable, *TEST_TOOLS, *TORCH_TEST_TOOLS, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """CPU tests of every package, of the benchmark scripts and of the README's commands, in
    one virtualenv (tests marked ``gpu`` are left out), one worker per core (pytest-xdist;
    ``nox -s tests -- -n 0`` runs them in one process)."""
    _install_all(session)
    session.run(
        "pytest",
        "-m",
        "not gpu",
        "-n",
        "auto",
        *TEST_DIRS,
        BENCH_TEST_DIR,
        DOC_TEST_DIR,
        *session.posargs,
    )


@nox.session
def solver_only(session: nox.Session) -> None:
    """offload-solver alone: no torch may be importable, and its tests pass."""
    session.install("-c", CONSTRAINTS, "packages/offload-solver", *TEST_TOOLS)
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; "
        "sys.exit('torch is installed in the solver-only environment') "
        "if importlib.util.find_spec('torch') else print('torch absent: ok')",
    )
    session.run("pytest", "packages/offload-solver/tests", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """``mypy --strict`` over the sources of every package, then over the benchmark
    scripts (which import each other, hence ``MYPYPATH``)."""
    _install_all(session, "mypy")
    session.run("mypy", "--strict", *SRC_DIRS, *session.posargs)
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py"))
    session.run("mypy", "--strict", *scripts, env={"MYPYPATH": str(ROOT / "benchmarks")})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _cuda_env(session: nox.Session, what: str) -> dict[str, str]:
    """Skip unless this interpreter has CUDA torch; the env that puts every src on the path."""
    try:
        import torch
    except ImportError:
        session.skip("torch is not importable in this interpreter")
    if not torch.cuda.is_available():
        session.skip(f"CUDA is not available here, and {what} run on an NVIDIA GPU only")
    return {
        "PYTHONPATH": os.pathsep.join(
            [*(str(ROOT / s) for s in SRC_DIRS), os.environ.get("PYTHONPATH", "")]
        )
    }


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """Tests marked ``gpu``, in the current interpreter (a CUDA machine may have no network).

    The hardware profiles the tests measure are cached in a folder of their own
    (``OFFLOAD_CACHE_DIR``, removed afterwards), not in the machine's profile cache: a
    profile read inside the test run, beside whatever the tests before it left running,
    reads the host slower than it is, and would otherwise be what every later plan and
    benchmark on the machine takes."""
    import tempfile

    env = _cuda_env(session, "the gpu tests")
    with tempfile.TemporaryDirectory(prefix="offload-gpu-tests-") as cache:
        env["OFFLOAD_CACHE_DIR"] = cache
        session.run("python", "-m", "pytest", "-m", "gpu", *TEST_DIRS, *session.posargs, env=env)


@nox.session(venv_backend="none")
def example(session: nox.Session) -> None:
    """The GPT-2 example (run.sh): on a GPU with this interpreter, else the CPU fallback.

    When the interpreter running nox has a CUDA build of torch and a GPU, run.sh runs with it
    and the packages' src folders on PYTHONPATH (a GPU machine may have no network, so
    nothing is installed). Otherwise a virtualenv in ``.nox/example-cpu`` gets every
    package (torch pinned by constraints.txt) and run.sh trains the CPU fallback there.
    Arguments after ``--`` go to the training script; MODEL_TYPE, BATCH_SIZE,
    MEMORY_BUDGET and SOLVER_TYPE are read from the environment as run.sh documents.
    """
    import subprocess
    import sys

    run_sh = str(ROOT / "packages/offload-gpt-example/run.sh")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ],
        capture_output=True,
        check=False,
    )
    if probe.returncode == 0:
        session.log(f"CUDA torch found in {sys.executable}: running run.sh with it")
        session.run("bash", run_sh, *session.posargs, env={"PYTHON": sys.executable}, external=True)
        return
    session.log("no CUDA torch in this interpreter: CPU fallback in .nox/example-cpu")
    venv = ROOT / ".nox" / "example-cpu"
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    if not python.exists():
        # virtualenv comes with nox; the stdlib venv needs python3-venv on Debian.
        session.run(sys.executable, "-m", "virtualenv", str(venv), external=True)
    editable = [arg for d in PACKAGE_DIRS for arg in ("-e", str(ROOT / d))]
    session.run(
        str(python), "-m", "pip", "install", "-q", "-c", CONSTRAINTS, *editable, external=True
    )
    env = {
        "PYTHON": str(python),
        "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")]),
    }
    session.run("bash", run_sh, *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """GPU benchmark against full-GPU training, FSDP2 and torchao (benchmarks/offload_bench.py).

    Runs in the current interpreter (CUDA torch; no network needed). Arguments after ``--``
    go to the script, e.g. ``nox -s bench -- --workloads W1 --out bench_out``.
    """
    env = _cuda_env(session, "benchmarks")
    session.run("python", str(ROOT / "benchmarks/offload_bench.py"), *session.posargs, env=env)
