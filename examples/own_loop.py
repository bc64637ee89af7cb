"""Adopt NoLoCo in your own training loop: the protocol hooks your optimizer, the loop stays yours.

Run it on each machine (the first prints the address the others pass to --join):
    python examples/own_loop.py --host 0.0.0.0        # starts a swarm, waits for a second peer
    python examples/own_loop.py --seed 1 --join /ip4/.../p2p/...
"""

import argparse

import torch

from decentral.data import eval_batches, evaluate, load_corpus, train_batches
from decentral.models import GPT, GPTConfig
from decentral.swarm import SwarmTransport
from decentral.sync import NoLoCo

parser = argparse.ArgumentParser()
parser.add_argument("--join", action="append", default=[])
parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
parser.add_argument("--min-peers", type=int, default=2, help="peers (this one included) to wait for before training")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--seed", type=int, default=0, help="data order; give each machine its own")
args = parser.parse_args()

torch.set_num_threads(1)
corpus = load_corpus()  # the Python standard library's own source
config = GPTConfig(n_layer=2, d_model=64, n_head=2, context=64)
model = GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = train_batches(corpus.train, batch_size=8, context=config.context, seed=args.seed)
val = eval_batches(corpus.val, batch_size=8, context=config.context, num_batches=4)

transport = SwarmTransport("own-loop-example", args.join, host=args.host, timeout=30)
print("others join with: --join", transport.multiaddrs()[0], flush=True)
try:
    with NoLoCo(model, optimizer, transport, every=20) as sync:  # ← the only new line in the loop
        transport.wait_for_peers(args.min_peers, 300, sync.first_round)  # SwarmError after 300 s without them
        print(f"start: val loss {evaluate(model, val):.3f}", flush=True)
        while sync.step < args.steps:
            x, y = next(data)
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()  # every 20th step also averages with a random peer
            optimizer.zero_grad()
            if (report := sync.pop_report()) is not None:
                print(f"step {sync.step}: loss {loss.item():.3f}, averaged with {len(report.group) - 1} peer(s)", flush=True)
        print(f"end: val loss {evaluate(model, val):.3f}", flush=True)
finally:
    transport.close()
