"""`decentral syncbench`: its peer's imports resolve (they broke once when pairing moved to decentral.sync),
a point needs a counted round besides the warm-up one, and a peer that fails ends its point."""

import subprocess
import sys

import pytest

from decentral.syncbench import PointFailed, _wait_for_peers, peer_main


def test_a_syncbench_peer_imports_what_it_uses():
    with pytest.raises(SystemExit) as done:
        peer_main(["--help"])  # the imports run before argparse answers --help
    assert done.value.code == 0


def test_one_round_is_refused_in_one_line(tmp_path, prefork):
    proc = prefork.run(["syncbench", "--rounds", "1"], tmp_path)
    assert proc.returncode == 2 and "at least 2" in proc.stderr
    for hosts, says in (("2,abc", "not comma-separated integers"), ("1", "at least 2 hosts"),
                        ("2,2", "2,2: a value given twice"), ("2,300", "2,300: at most 253")):  # (2,2 ran twice)
        proc = prefork.run(["syncbench", "--hosts", hosts], tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_a_point_ends_as_soon_as_one_peer_fails_naming_its_log(tmp_path):
    """The peer that fails (a dead join address, say) is named at once; the point does not wait for the
    others, which would wait for it (h0 here would run for 10 minutes)."""
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(PointFailed, match=r"peer h1 exited with 3; see .*h1\.log"):
            _wait_for_peers([waiting, failing], tmp_path)
        assert waiting.poll() is None
    finally:
        waiting.kill()
        waiting.wait()
