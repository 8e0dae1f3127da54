"""Issue 18 item 7: pip installs pydist the standard way (pyproject.toml).

Builds a copy of the sources into a fresh virtual environment that sees the
torch of the environment running the tests (``make_venv``: nothing is
downloaded for torch; that environment may itself be a venv or a conda env),
first with no ``wheel`` package anywhere in reach, then again with ``wheel``
installed in the environment (the setup in which pip 23 used to take the
legacy ``setup.py develop`` path and fail). Two builds of the CPU extension:
minutes, within CI's budget; the second reuses the first one's objects.
The machine's own pydist install is never touched: pip installs into the venv.
"""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")),
                                reason="needs the git checkout to copy the sources from")


def make_venv(path, python=sys.executable):
    """A venv at ``path`` without pip's packages of its own that sees every
    package of ``python``'s environment, as ``--system-site-packages`` does
    from the machine's own interpreter. From a venv, ``--system-site-packages``
    alone reaches the base interpreter's site-packages, not the venv's (where
    its torch is): the venv's site directories are added by a .pth after the
    new venv's own (``site.addsitedir``, so their .pth files apply too). A conda
    env's python is a base interpreter: the .pth only repeats its directories."""
    run([python, "-m", "venv", "--system-site-packages", "--without-pip", str(path)])
    sites = run([python, "-c", "import site, sys; print(repr(site.getsitepackages()"
                 " + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))"]).strip()
    purelib = run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    with open(os.path.join(purelib.strip(), "_outer_environment.pth"), "w") as pth:
        pth.write(f"import site; list(map(site.addsitedir, {sites}))\n")
    return str(path / "bin" / "python")


def run(cmd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PYDIST_CUDA="0", MAX_JOBS="2", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.timeout(1800)
def test_pip_install_in_a_fresh_venv_with_and_without_wheel(tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if name.endswith(".so") or not os.path.isfile(os.path.join(REPO, name)):
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), src / name)
    python = make_venv(venv)
    check = ("import importlib.metadata as m, importlib.util, pydist, pydist._C, torch; "
             "print(pydist.__file__); print(m.version('pydist')); print(sorted(m.metadata('pydist').get_all('Provides-Extra'))); "
             "print(importlib.util.find_spec('wheel') is not None)")

    def install(*args):
        run([python, "-m", "pip", "install", "--no-build-isolation", *args], cwd=tmp_path, timeout=1200)
        return run([python, "-c", check], cwd=tmp_path, timeout=120).split("\n")

    if run([python, "-c", "import importlib.util; print(importlib.util.find_spec('wheel') is not None)"]).strip() \
            == "False":
        path, version, extras, has_wheel = install("-e", str(src))[:4]
        assert path == str(src / "pydist" / "__init__.py")  # the editable install points at the copy
        assert (version, extras, has_wheel) == ("0.1.0", "['dev', 'mpi']", "False")
    run([python, "-m", "pip", "install", "wheel"], timeout=300)
    path, version, extras, has_wheel = install("-e", str(src))[:4]
    assert path == str(src / "pydist" / "__init__.py")
    assert (version, extras, has_wheel) == ("0.1.0", "['dev', 'mpi']", "True")


@pytest.mark.timeout(120)
def test_setup_refuses_a_compiler_that_would_link_libstdcxx_statically(tmp_path):
    """A toolchain with only libstdc++.a builds an extension that crashes
    inside torch's process (seen on a GPU image whose g++ wrapper finds no
    libstdc++.so): setup.py refuses it before compiling, naming CXX."""
    cxx = tmp_path / "g++"
    cxx.write_text('#!/bin/sh\ncase "$1" in -print-file-name=*) echo "${1#-print-file-name=}";; '
                   '*) exec g++ "$@";; esac\n')
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CXX=str(cxx), PYDIST_CUDA="0")
    done = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode != 0, done.stdout
    assert f"the C++ compiler '{cxx}' finds no shared libstdc++" in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_a_venv_made_from_a_venv_sees_the_outer_venvs_packages(tmp_path):
    """make test from a user's venv (issue 43): the venv above is then made from
    a venv's python, whose torch lives in that venv's site-packages, not in the
    base interpreter's. Here an outer venv stands for the user's: it sees this
    environment through a .pth and holds a module of its own, which the inner
    venv must import, as it would the user's torch."""
    outer = make_venv(tmp_path / "outer")
    purelib = run([outer, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    with open(os.path.join(purelib, "only_in_the_outer_venv.py"), "w") as module:
        module.write("WHERE = __file__\n")
    helper = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); from test_install import make_venv; "
              "print(make_venv(pathlib.Path(sys.argv[2]), sys.executable))")
    inner = run([outer, "-c", helper, os.path.dirname(os.path.abspath(__file__)), str(tmp_path / "inner")]).strip()
    assert inner == str(tmp_path / "inner" / "bin" / "python")
    found = run([inner, "-c", "import sys, only_in_the_outer_venv as m, torch, pytest; "
                 "print(m.WHERE); print(sys.prefix)"])
    assert found.split("\n")[:2] == [os.path.join(purelib, "only_in_the_outer_venv.py"), str(tmp_path / "inner")]
    # The README's commands, as the outer venv's make runs them: every recipe line uses its python.
    dry = run(["make", "-n", "-B", "demo", "test", f"PYTHON={outer}"], cwd=REPO)
    for line in (f"{outer} -m pytest tests", f"{outer} -m torch.distributed.run",
                 f"{outer} -m mpi4py -m pytest tests/mpi", f"{outer} -m pip install --no-build-isolation -e ."):
        assert line in dry, dry
