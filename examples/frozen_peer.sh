#!/usr/bin/env bash
# A peer that hangs (alive and connected, but silent: a laptop's lid closed, a debugger, a stalled host),
# run as a user runs it: a keyed DiLoCo swarm of three `decentral train` processes on loopback with the
# default sync timeout (60 s); w2 is SIGSTOPped after its step 100 for 30 s, then resumed. Prints, for
# each peer, at every round boundary (step), the group size, whether it committed, and what it waited.
# Usage: examples/frozen_peer.sh [OUT]   (about 2 minutes on 2 cores)
set -u
OUT=${1:-runs/frozen-peer}
D=${DECENTRAL:-decentral}
PY=${PYTHON:-python3}
rm -rf "$OUT"; mkdir -p "$OUT"
"$D" swarm keygen "$OUT/swarm.key" >/dev/null
common=(--protocol diloco --swarm-key "$OUT/swarm.key" --steps 300 --num-workers 3 --min-peers 3 --timeout 60)
"$D" train "${common[@]}" --out "$OUT/w0" --name w0 --worker-index 0 --maddr-file "$OUT/maddr" > "$OUT/w0.log" 2>&1 &
P0=$!
until [ -s "$OUT/maddr" ]; do sleep 0.5; done
JOIN=$(head -1 "$OUT/maddr")
"$D" train "${common[@]}" --out "$OUT/w1" --name w1 --worker-index 1 --join "$JOIN" > "$OUT/w1.log" 2>&1 &
P1=$!
"$D" train "${common[@]}" --out "$OUT/w2" --name w2 --worker-index 2 --join "$JOIN" > "$OUT/w2.log" 2>&1 &
P2=$!
until grep -q "step   100" "$OUT/w2.log" 2>/dev/null; do sleep 0.5; done
kill -STOP "$P2"; echo "stopped w2 after its step 100"
sleep 30
kill -CONT "$P2"; echo "resumed w2 30 s later"
wait "$P0" "$P1" "$P2"
"$PY" - "$OUT" <<'EOF'
import json, sys
for w in ("w0", "w1", "w2"):
    rounds = [r for r in map(json.loads, open(f"{sys.argv[1]}/{w}/metrics.jsonl")) if "group_size" in r]
    waits = [b["wait_s"] - a["wait_s"] for a, b in zip([{"wait_s": 0.0}] + rounds, rounds)]
    print(f"--- {w}: step (group size, committed, seconds waited since the last boundary)")
    print("  ".join(f"{r['step']} ({r['group_size']}, {'yes' if r['complete'] else 'no'}, {dt:.1f})"
                    for r, dt in zip(rounds, waits)))
    print(f"    final val {[r for r in map(json.loads, open(f'{sys.argv[1]}/{w}/metrics.jsonl')) if 'val_loss' in r][-1]['val_loss']:.4f}")
EOF
