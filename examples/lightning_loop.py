"""Train decentral's GPT as a LightningModule under DiLoCo: the Lightning Trainer stays as it is, one callback
joins it to the swarm (pip install 'decentral[lightning]').

    python examples/lightning_loop.py --peers 2 --steps 40    # 2 peers in this process, over a real swarm on loopback

Across machines, one peer each (the first prints the address the others pass to --join):
    python examples/lightning_loop.py --host 0.0.0.0 --min-peers 2
    python examples/lightning_loop.py --host 0.0.0.0 --join /ip4/.../p2p/...
"""

import argparse
from concurrent.futures import ThreadPoolExecutor

import lightning
import torch

from decentral.data import eval_batches, evaluate, load_corpus, train_batches
from decentral.integrations.lightning import DecentralCallback
from decentral.models import GPT, GPTConfig
from decentral.swarm import SwarmTransport

parser = argparse.ArgumentParser()
parser.add_argument("--peers", type=int, default=1, help="peers this process runs")
parser.add_argument("--min-peers", type=int, help="peers to wait for before training (default: --peers)")
parser.add_argument("--join", action="append", default=[])
parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--every", type=int, default=10, help="inner steps per DiLoCo round")
parser.add_argument("--seed", type=int, default=0, help="data order of the first peer here; give each machine its own")
args = parser.parse_args()

config = GPTConfig(n_layer=2, d_model=64, n_head=2, context=64)
corpus = load_corpus(max_bytes=1_000_000)  # the Python standard library's own source, one token per byte
val = eval_batches(corpus.val, batch_size=8, context=config.context, num_batches=4)


class Batches(torch.utils.data.IterableDataset):
    """Endless batches of random windows of the training bytes."""

    def __init__(self, seed: int):
        self.seed = seed

    def __iter__(self):
        return train_batches(corpus.train, batch_size=8, context=config.context, seed=self.seed)


class LitGPT(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def make_peer(index: int, transport: SwarmTransport) -> tuple[LitGPT, lightning.Trainer, DecentralCallback]:
    torch.manual_seed(0)
    module = LitGPT()
    sync = DecentralCallback("diloco", transport, peers=args.min_peers or args.peers, every=args.every)  # ← the new line
    trainer = lightning.Trainer(max_steps=args.steps, callbacks=[sync], accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return module, trainer, sync


def train(index: int, module: LitGPT, trainer: lightning.Trainer, sync: DecentralCallback) -> torch.nn.Module:
    before = evaluate(module.model, val)
    trainer.fit(module, torch.utils.data.DataLoader(Batches(args.seed + index), batch_size=None))
    print(f"peer {index}: val loss {before:.3f} -> {evaluate(module.model, val):.3f}, {len(sync.adoption.reports)} "
          f"DiLoCo rounds, {sync.adoption.transport.bytes_sent / 2**20:.2f} MiB sent", flush=True)
    return module.model


torch.set_num_threads(1)
first = SwarmTransport("lightning-example", args.join, host=args.host, timeout=30)
transports = [first] + [SwarmTransport("lightning-example", first.multiaddrs(), timeout=30) for _ in range(args.peers - 1)]
print("others join with: --join", first.multiaddrs()[0], flush=True)
try:
    peers = [make_peer(i, t) for i, t in enumerate(transports)]  # here, not in the threads: torch's RNG is global
    with ThreadPoolExecutor(args.peers) as pool:
        models = list(pool.map(train, range(args.peers), *zip(*peers)))
    if len(models) > 1 and args.steps % args.every == 0:
        same = all(torch.equal(a, b) for m in models[1:] for a, b in zip(models[0].parameters(), m.parameters()))
        print(f"the peers' models are identical after the last round: {same}", flush=True)
finally:
    for transport in transports:
        transport.close()
