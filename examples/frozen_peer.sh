#!/usr/bin/env bash
# A peer that hangs (alive and connected, but silent: a laptop's lid closed, a debugger, a stalled host),
# run as a user runs it: a keyed DiLoCo swarm of three `decentral train` processes on loopback with the
# default sync timeout (60 s); w2 is SIGSTOPped after its step 100 for STOP_S seconds (default 30), then
# resumed. Prints, for each peer, at every round boundary (step), the group size, whether it committed, and
# what it waited.
# Usage: [STOP_S=30] [PROTOCOL=diloco] examples/frozen_peer.sh [OUT]   (about 2 minutes on 2 cores)
set -u
OUT=${1:-runs/frozen-peer}
D=${DECENTRAL:-decentral}
PY=${PYTHON:-python3}
STOP_S=${STOP_S:-30}
source "$(dirname "$0")/keyed_diloco_swarm.sh"
start_keyed_swarm "$OUT"
kill -STOP "$P2"; echo "stopped w2 after its step 100"
sleep "$STOP_S"
kill -CONT "$P2"; echo "resumed w2 $STOP_S s later"
wait "$P0" "$P1" "$P2"
"$PY" - "$OUT" <<'EOF'
import json, sys
for w in ("w0", "w1", "w2"):
    records = [json.loads(line) for line in open(f"{sys.argv[1]}/{w}/metrics.jsonl")]
    rounds = [r for r in records if "group_size" in r]
    waits = [b["wait_s"] - a["wait_s"] for a, b in zip([{"wait_s": 0.0}] + rounds, rounds)]
    print(f"--- {w}: step (group size, committed, seconds waited since the last boundary)")
    print("  ".join(f"{r['step']} ({r['group_size']}, {'yes' if r['complete'] else 'no'}, {dt:.1f})"
                    for r, dt in zip(rounds, waits)))
    print(f"    final val {[r['val_loss'] for r in records if 'val_loss' in r][-1]:.4f}")
EOF
