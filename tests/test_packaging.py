"""What a user gets from `pip install decentral` (no editable checkout): the shipped recipes come with it."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_wheel_carries_every_shipped_recipe_and_an_installed_copy_finds_them_by_name(tmp_path):
    source = tmp_path / "source"  # built from a copy: no build/ or egg-info of an earlier build in the way
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "runs", "__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel, = (tmp_path / "dist").glob("decentral-*.whl")
    shipped = {f"decentral/{kind}/{p.name}" for kind in ("protocols", "merges") for p in (REPO / kind).glob("*.yaml")}
    assert len(shipped) > 10
    assert shipped <= set(zipfile.ZipFile(wheel).namelist())

    zipfile.ZipFile(wheel).extractall(tmp_path / "site")  # a wheel is installed by unpacking it
    probe = ("import decentral, decentral.config as c, decentral.merge.recipe as m\n"
             "assert decentral.__file__.startswith(%r), decentral.__file__\n"
             "for name in ('diloco', 'noloco', 'co2', 'streaming', 'ddp', 'local'):\n"
             "    c.load_recipe(c.recipe_path(name))\n"
             "print(m.load_merge_recipe(c.SHIPPED / 'merges' / 'ties.yaml').method.name)\n") % str(tmp_path)
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["ties"]
