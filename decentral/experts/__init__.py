"""Branch-train-merge: experts trained apart from a shared seed, then ensembled or merged.

registry.py  expert folders (model + metadata, hashes) and a registry of them
branch.py    where training starts: a checkpoint or an expert, optimizer state and schedule continued
ensemble.py  the domain-posterior mixture of experts (log-space), prior estimation and caching
sharing.py   publish and fetch experts through the swarm (DHT record + direct stream, hash-checked)
clusters.py  c-BTM: documents clustered without labels, routing by distance to cluster centres
"""
