"""`decentral syncbench`: its peer's imports resolve (they broke once when pairing moved to decentral.sync)
and a point needs a counted round besides the warm-up one."""

import pytest

from decentral.syncbench import peer_main


def test_a_syncbench_peer_imports_what_it_uses():
    with pytest.raises(SystemExit) as done:
        peer_main(["--help"])  # the imports run before argparse answers --help
    assert done.value.code == 0


def test_one_round_is_refused_in_one_line(tmp_path, prefork):
    proc = prefork.run(["syncbench", "--rounds", "1"], tmp_path)
    assert proc.returncode == 2 and "at least 2" in proc.stderr
    for hosts, says in (("2,abc", "not comma-separated integers"), ("1", "at least 2 hosts")):
        proc = prefork.run(["syncbench", "--hosts", hosts], tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
